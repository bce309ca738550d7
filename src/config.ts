import { hostname } from 'node:os';
import { ConfigError } from './errors.js';
import {
  CidrRange,
  compileTargetPolicy,
  InvalidCidrError,
  type TargetPolicy,
} from './security/target-policy.js';
import { ClusterEndpoints, configuredEndpoints } from './security/cluster-endpoints.js';
import { sensitiveHeaderSet } from './security/sensitive-headers.js';

/** What a node does; every node may have any subset. */
export type Role = 'scheduler' | 'worker' | 'api';
const ROLES: readonly Role[] = ['scheduler', 'worker', 'api'];

export type ApiRole = 'admin' | 'viewer';

/** The validated, defaulted, frozen settings of one node. Only this module reads `process.env`. */
export interface HeliosConfig {
  /** HELIOS_NODE_ID: unique per node; default `<hostname>-<pid>`. */
  readonly nodeId: string;
  /** HELIOS_ROLES: comma list of scheduler, worker, api; default all three. */
  readonly roles: ReadonlySet<Role>;
  /** HELIOS_HTTP_HOST: address the HTTP server binds; default 127.0.0.1. */
  readonly httpHost: string;
  /** HELIOS_HTTP_PORT: port of the HTTP server (0 = any free port); default 8080. */
  readonly httpPort: number;
  /** HELIOS_PUBLIC_URL: the URL other nodes and tools use to reach this node's API; default from host and port. */
  readonly publicUrl: string | undefined;
  /** HELIOS_DATABASE_URL: PostgreSQL connection string (required). */
  readonly databaseUrl: string;
  /** HELIOS_DATABASE_POOL_SIZE: connections in this node's pool; default 20. */
  readonly databasePoolSize: number;
  /** HELIOS_ETCD_ENDPOINTS: comma list of etcd client URLs (required). */
  readonly etcdEndpoints: readonly string[];
  /** HELIOS_ETCD_PREFIX: key prefix for the leader key and node registry; default `/helios`. */
  readonly etcdPrefix: string;
  /** HELIOS_KAFKA_BROKERS: comma list of host:port (required). */
  readonly kafkaBrokers: readonly string[];
  /** HELIOS_KAFKA_TOPIC: dispatch topic; default `helios.runs`. */
  readonly runsTopic: string;
  /** HELIOS_KAFKA_DLQ_TOPIC: dead-letter topic; default `helios.runs.dlq`. */
  readonly deadLetterTopic: string;
  /** HELIOS_KAFKA_PARTITIONS: partitions when creating the topics; default 6. */
  readonly topicPartitions: number;
  /**
   * HELIOS_KAFKA_REPLICATION_FACTOR: replicas of each topic when a node creates the topics; default 1
   * (a single broker). A cluster of 3 or more brokers wants 3, with the broker's
   * `min.insync.replicas` at 2 (the publisher uses acks=all). An existing topic is left as it is.
   */
  readonly topicReplicationFactor: number;
  /** HELIOS_KAFKA_GROUP: consumer group of the workers; default `helios-workers`. */
  readonly consumerGroup: string;
  /** HELIOS_LEASE_TTL_MS: leader lease TTL (rounded up to whole seconds for etcd); default 3000. */
  readonly leaseTtlMs: number;
  /** HELIOS_LEADER_SAFETY_MARGIN_MS: a leader stops this long before its lease could expire; default 500. */
  readonly leaderSafetyMarginMs: number;
  /** HELIOS_WORKER_CONCURRENCY: runs executing at once on this node; default 64. */
  readonly workerConcurrency: number;
  /**
   * HELIOS_WORKER_PREFETCH: run announcements a worker holds in memory until they are due (the
   * dispatcher publishes runs up to the lookahead early); fetching from Kafka pauses at this many;
   * default 5000 (a few kilobytes each).
   */
  readonly workerPrefetch: number;
  /** HELIOS_CLAIM_GRACE_MS: a claim's deadline is now + the run's timeout + this; default 5000. */
  readonly claimGraceMs: number;
  /**
   * HELIOS_CLOCK_SKEW_TOLERANCE_MS: a worker may claim a run this long before its not_before by
   * the database clock, absorbing the error of its clock estimate; default 10.
   */
  readonly clockSkewToleranceMs: number;
  /**
   * HELIOS_CLAIM_LEAD_MS: a worker claims an `allow` run up to this long before it is due and
   * starts the HTTP call exactly when due, keeping the claim's round trip off the critical path
   * (forbid and replace runs are claimed only when due); default 50.
   */
  readonly claimLeadMs: number;
  /** HELIOS_POLL_INTERVAL_MS: period of the workers' polling fallback; default 1000. */
  readonly pollIntervalMs: number;
  /** HELIOS_POLL_OVERDUE_MS: the polling fallback claims queued runs this overdue; default 2000. */
  readonly pollOverdueMs: number;
  /** HELIOS_CLAIM_CHECK_INTERVAL_MS: how often a worker checks that it still holds its claims; default 1000. */
  readonly claimCheckIntervalMs: number;
  /** HELIOS_REAPER_INTERVAL_MS: longest pause between the leader's passes over expired claims; default 1000. */
  readonly reaperIntervalMs: number;
  /** HELIOS_RESPONSE_EXCERPT_BYTES: bytes of a target's response body kept per attempt; default 2048. */
  readonly responseExcerptBytes: number;
  /**
   * HELIOS_DISPATCH_LOOKAHEAD_MS: runs are created (and published) up to this long before they are
   * due, so workers hold them and fire on time; default 5000, enough to create a herd of 10,000
   * jobs due in the same second before it is due on 2 cores. An edit of a job through the API
   * withdraws its runs created ahead (see PATCH /jobs/{id}).
   */
  readonly dispatchLookaheadMs: number;
  /** HELIOS_MISFIRE_THRESHOLD_MS: an occurrence found this late is a misfire (handled by the job's `misfire` policy); default 5000. */
  readonly misfireThresholdMs: number;
  /** HELIOS_DISPATCH_BATCH: jobs per dispatch transaction; default 500. */
  readonly dispatchBatchSize: number;
  /** HELIOS_SHUTDOWN_TIMEOUT_MS: how long shutdown waits for in-flight runs; default 10000. */
  readonly shutdownTimeoutMs: number;
  /** HELIOS_API_TOKENS: `token:role` pairs (role admin or viewer). */
  readonly apiTokens: ReadonlyMap<string, ApiRole>;
  /** HELIOS_METRICS_PUBLIC: `true` serves /metrics without a token even when tokens are configured; default false. */
  readonly metricsPublic: boolean;
  /**
   * Where job targets may point, checked when a job is saved and again, after DNS, when it is
   * executed. Deny wins over allow. Settings:
   * - HELIOS_TARGET_DENY: CIDR ranges refused in addition to the defaults (link-local, cloud
   *   metadata addresses, "this host"); default none.
   * - HELIOS_TARGET_DENY_DEFAULTS: `false` drops those defaults (only for a network without a
   *   metadata service); default true.
   * - HELIOS_TARGET_POLICY: `strict` also refuses loopback and private ranges (recommended in
   *   production); default `permissive`.
   * - HELIOS_TARGET_ALLOW: CIDR ranges allowed exclusively; default empty (all not denied).
   * The configured etcd, Kafka and PostgreSQL endpoints and every node's API are always refused
   * (`targetPolicy.cluster`; the node adds its own API address and the registry's once started).
   */
  readonly targetPolicy: TargetPolicy;
  /** HELIOS_TARGET_POLICY: `strict` or `permissive` (see targetPolicy). */
  readonly targetPolicyMode: 'strict' | 'permissive';
  /** HELIOS_SENSITIVE_HEADERS: header names added to authorization, cookie, proxy-authorization, x-api-key, whose values show as `***`. */
  readonly sensitiveHeaders: ReadonlySet<string>;
  /**
   * HELIOS_API_RATE_LIMIT requests per HELIOS_API_RATE_WINDOW_MS per token (per client address
   * without a valid token), on each node; then 429 with Retry-After. Defaults 6000 per 60000 ms;
   * HELIOS_API_RATE_LIMIT=0 turns the limit off. Null when off.
   */
  readonly apiRateLimit: { readonly max: number; readonly windowMs: number } | null;
  /** HELIOS_API_BODY_LIMIT: largest accepted API request body in bytes; default 262144 (256 KiB). */
  readonly apiBodyLimit: number;
  /** HELIOS_LOG_LEVEL: pino level; default info. */
  readonly logLevel: string;
  /** Retention of history, applied by the leader's pruner. */
  readonly retention: {
    /** HELIOS_RUN_RETENTION: finished runs (with attempts and resolved dead letters) older than this are deleted; default 30d. */
    readonly runsMs: number;
    /** HELIOS_RUN_KEEP_PER_JOB: the newest runs of each job kept whatever their age; default 100. */
    readonly keepPerJob: number;
    /** HELIOS_OUTBOX_RETENTION: published outbox rows are deleted after this; default 10m. */
    readonly outboxMs: number;
  };

  // Leader isolation and the cluster signals.
  /**
   * HELIOS_LEADER_POOL_SIZE: connections of the leader's own pool (dispatcher, outbox relay,
   * reaper, pruner, cluster gauges), opened only while the node leads, in addition to
   * HELIOS_DATABASE_POOL_SIZE; default 5 (one per leader loop).
   */
  readonly leaderPoolSize: number;
  /**
   * HELIOS_WORKER_DB_CONNECTIONS: connections of the node's pool the worker may use at once for its
   * runs (claims, completions, retries); below HELIOS_DATABASE_POOL_SIZE so the API and readiness
   * always find one; default three quarters of the pool (15 of 20; at least 1).
   */
  readonly workerDbConnections: number;
  /** HELIOS_SIGNALS_INTERVAL_MS: how often the leader refreshes the cluster gauges (queues, dead letters, Kafka lag); default 5000. */
  readonly signalsIntervalMs: number;
}

type Env = Record<string, string | undefined>;

function str(env: Env, name: string, fallback?: string): string {
  const raw = env[name]?.trim();
  if (raw) return raw;
  if (fallback !== undefined) return fallback;
  throw new ConfigError(name, 'is required');
}

function int(env: Env, name: string, fallback: number, min: number, max: number): number {
  const raw = env[name]?.trim();
  if (!raw) return fallback;
  if (!/^-?\d+$/.test(raw)) throw new ConfigError(name, `must be an integer, got "${raw}"`);
  const value = Number(raw);
  if (value < min || value > max)
    throw new ConfigError(name, `must be between ${min} and ${max}, got ${value}`);
  return value;
}

const DURATION_UNITS: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 };

/** A duration: milliseconds, or a number with a unit (`500ms`, `90s`, `15m`, `12h`, `30d`). */
function duration(env: Env, name: string, fallbackMs: number, minMs: number, maxMs: number): number {
  const raw = env[name]?.trim();
  if (!raw) return fallbackMs;
  const match = /^(\d+)(ms|s|m|h|d)?$/.exec(raw);
  if (!match)
    throw new ConfigError(name, `must be a duration like 30d, 12h, 15m, 90s or milliseconds, got "${raw}"`);
  const value = Number(match[1]) * DURATION_UNITS[match[2] ?? 'ms']!;
  if (value < minMs || value > maxMs)
    throw new ConfigError(name, `must be between ${minMs} ms and ${maxMs} ms, got ${value} ms`);
  return value;
}

function list(env: Env, name: string, check: (item: string) => string | null): string[] {
  const items = str(env, name)
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean);
  if (items.length === 0) throw new ConfigError(name, 'is required');
  for (const item of items) {
    const problem = check(item);
    if (problem) throw new ConfigError(name, `${problem}: "${item}"`);
  }
  return items;
}

function checkUrl(protocols: string[]) {
  return (item: string): string | null => {
    try {
      const url = new URL(item);
      return protocols.includes(url.protocol) ? null : `protocol must be one of ${protocols.join(' ')}`;
    } catch {
      return 'is not a URL';
    }
  };
}

function checkHostPort(item: string): string | null {
  return /^[A-Za-z0-9.[\]:-]+:\d{1,5}$/.test(item) ? null : 'must be host:port';
}

function parseRoles(env: Env): Set<Role> {
  const raw = env.HELIOS_ROLES?.trim() || ROLES.join(',');
  const roles = new Set<Role>();
  for (const item of raw.split(',').map((s) => s.trim())) {
    if (!ROLES.includes(item as Role)) {
      throw new ConfigError('HELIOS_ROLES', `unknown role "${item}" (expected ${ROLES.join(', ')})`);
    }
    roles.add(item as Role);
  }
  return roles;
}

function parseTokens(env: Env): Map<string, ApiRole> {
  const tokens = new Map<string, ApiRole>();
  const raw = env.HELIOS_API_TOKENS?.trim();
  if (!raw) return tokens;
  for (const [index, pair] of raw.split(',').entries()) {
    const cut = pair.lastIndexOf(':');
    const token = pair.slice(0, cut).trim();
    const role = pair.slice(cut + 1).trim();
    // The token itself never goes into an error message: only its position.
    if (cut <= 0 || (role !== 'admin' && role !== 'viewer')) {
      throw new ConfigError('HELIOS_API_TOKENS', `entry ${index + 1} must be token:admin or token:viewer`);
    }
    if (token.length < 16) {
      throw new ConfigError('HELIOS_API_TOKENS', `entry ${index + 1}: tokens must be at least 16 characters`);
    }
    tokens.set(token, role);
  }
  return tokens;
}

function bool(env: Env, name: string, fallback: boolean): boolean {
  const raw = env[name]?.trim().toLowerCase();
  if (!raw) return fallback;
  if (['true', '1', 'yes'].includes(raw)) return true;
  if (['false', '0', 'no'].includes(raw)) return false;
  throw new ConfigError(name, `must be true or false, got "${raw}"`);
}

/** A comma list of CIDR ranges; [] when unset or `none`. */
function cidrs(env: Env, name: string): string[] {
  const raw = env[name]?.trim();
  if (!raw || raw.toLowerCase() === 'none') return [];
  const items = raw
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean);
  for (const item of items) {
    try {
      CidrRange.parse(item);
    } catch (err) {
      if (err instanceof InvalidCidrError) throw new ConfigError(name, err.message);
      throw err;
    }
  }
  return items;
}

function parseSensitiveHeaders(env: Env): ReadonlySet<string> {
  const extra = (env.HELIOS_SENSITIVE_HEADERS ?? '')
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean);
  const bad = extra.find((h) => !/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(h));
  if (bad !== undefined) throw new ConfigError('HELIOS_SENSITIVE_HEADERS', `"${bad}" is not a header name`);
  return sensitiveHeaderSet(extra);
}

function rateLimitOf(env: Env): { max: number; windowMs: number } | null {
  const max = int(env, 'HELIOS_API_RATE_LIMIT', 6000, 0, 10_000_000);
  const windowMs = int(env, 'HELIOS_API_RATE_WINDOW_MS', 60_000, 100, 3_600_000);
  return max === 0 ? null : Object.freeze({ max, windowMs });
}

function parsePolicyMode(env: Env): 'strict' | 'permissive' {
  const raw = (env.HELIOS_TARGET_POLICY?.trim() || 'permissive').toLowerCase();
  if (raw !== 'strict' && raw !== 'permissive') {
    throw new ConfigError('HELIOS_TARGET_POLICY', `must be strict or permissive, got "${raw}"`);
  }
  return raw;
}

/** True for addresses only this host can reach. */
export function isLoopbackHost(host: string): boolean {
  const bare = host.replace(/^\[(.*)\]$/, '$1').toLowerCase();
  return bare === 'localhost' || bare === '::1' || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(bare);
}

/**
 * The leader's pool and the worker's share of the node's pool. The share must leave at least one
 * connection of the pool to the API and the readiness probe, whatever the worker's runs do.
 */
function isolationOf(env: Env, databasePoolSize: number) {
  return {
    leaderPoolSize: int(env, 'HELIOS_LEADER_POOL_SIZE', 5, 1, 100),
    workerDbConnections: int(
      env,
      'HELIOS_WORKER_DB_CONNECTIONS',
      Math.max(1, Math.floor((databasePoolSize * 3) / 4)),
      1,
      databasePoolSize - 1,
    ),
    signalsIntervalMs: int(env, 'HELIOS_SIGNALS_INTERVAL_MS', 5000, 100, 600_000),
  };
}

/** Validates and freezes the configuration; throws ConfigError naming the first bad variable. */
export function loadConfig(env: Env = process.env): HeliosConfig {
  const leaseTtlMs = int(env, 'HELIOS_LEASE_TTL_MS', 3000, 2000, 60_000);
  const leaderSafetyMarginMs = int(env, 'HELIOS_LEADER_SAFETY_MARGIN_MS', 500, 100, 10_000);
  if (leaderSafetyMarginMs >= leaseTtlMs / 2) {
    throw new ConfigError('HELIOS_LEADER_SAFETY_MARGIN_MS', `must be less than half of HELIOS_LEASE_TTL_MS`);
  }
  const nodeId = str(env, 'HELIOS_NODE_ID', `${hostname()}-${process.pid}`);
  if (!/^[A-Za-z0-9._-]{1,64}$/.test(nodeId)) {
    throw new ConfigError('HELIOS_NODE_ID', 'must be 1-64 characters of letters, digits, ".", "_" or "-"');
  }
  const publicUrl = env.HELIOS_PUBLIC_URL?.trim() || undefined;
  if (publicUrl) {
    const problem = checkUrl(['http:', 'https:'])(publicUrl);
    if (problem) throw new ConfigError('HELIOS_PUBLIC_URL', problem);
  }
  const etcdPrefix = str(env, 'HELIOS_ETCD_PREFIX', '/helios').replace(/\/+$/, '');
  if (!etcdPrefix.startsWith('/')) throw new ConfigError('HELIOS_ETCD_PREFIX', 'must start with "/"');
  const logLevel = str(env, 'HELIOS_LOG_LEVEL', 'info');
  if (!['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'].includes(logLevel)) {
    throw new ConfigError('HELIOS_LOG_LEVEL', `unknown level "${logLevel}"`);
  }
  const databaseUrl = str(env, 'HELIOS_DATABASE_URL');
  const dbProblem = checkUrl(['postgres:', 'postgresql:'])(databaseUrl);
  if (dbProblem) throw new ConfigError('HELIOS_DATABASE_URL', dbProblem);

  const httpHost = str(env, 'HELIOS_HTTP_HOST', '127.0.0.1');
  const apiTokens = parseTokens(env);
  // Without tokens the API is open to whoever reaches it, so it must stay on this host.
  if (apiTokens.size === 0 && !isLoopbackHost(httpHost)) {
    throw new ConfigError(
      'HELIOS_HTTP_HOST',
      `binding "${httpHost}" requires HELIOS_API_TOKENS; without tokens only a loopback address is allowed`,
    );
  }

  const httpPort = int(env, 'HELIOS_HTTP_PORT', 8080, 0, 65535);
  const etcdEndpoints = list(env, 'HELIOS_ETCD_ENDPOINTS', checkUrl(['http:', 'https:']));
  const kafkaBrokers = list(env, 'HELIOS_KAFKA_BROKERS', checkHostPort);
  const targetPolicyMode = parsePolicyMode(env);
  const cluster = new ClusterEndpoints(
    configuredEndpoints(etcdEndpoints, kafkaBrokers, databaseUrl, {
      host: httpHost,
      port: httpPort,
      publicUrl,
    }),
  );

  const databasePoolSize = int(env, 'HELIOS_DATABASE_POOL_SIZE', 20, 2, 500);
  const config: HeliosConfig = {
    nodeId,
    roles: parseRoles(env),
    httpHost,
    httpPort,
    publicUrl,
    databaseUrl,
    databasePoolSize,
    etcdEndpoints,
    etcdPrefix,
    kafkaBrokers,
    runsTopic: str(env, 'HELIOS_KAFKA_TOPIC', 'helios.runs'),
    deadLetterTopic: str(env, 'HELIOS_KAFKA_DLQ_TOPIC', 'helios.runs.dlq'),
    topicPartitions: int(env, 'HELIOS_KAFKA_PARTITIONS', 6, 1, 1000),
    topicReplicationFactor: int(env, 'HELIOS_KAFKA_REPLICATION_FACTOR', 1, 1, 32),
    consumerGroup: str(env, 'HELIOS_KAFKA_GROUP', 'helios-workers'),
    leaseTtlMs,
    leaderSafetyMarginMs,
    workerConcurrency: int(env, 'HELIOS_WORKER_CONCURRENCY', 64, 1, 10_000),
    workerPrefetch: int(env, 'HELIOS_WORKER_PREFETCH', 5000, 1, 100_000),
    claimGraceMs: int(env, 'HELIOS_CLAIM_GRACE_MS', 5000, 100, 3_600_000),
    clockSkewToleranceMs: int(env, 'HELIOS_CLOCK_SKEW_TOLERANCE_MS', 10, 0, 10_000),
    claimLeadMs: int(env, 'HELIOS_CLAIM_LEAD_MS', 50, 0, 10_000),
    pollIntervalMs: int(env, 'HELIOS_POLL_INTERVAL_MS', 1000, 50, 600_000),
    pollOverdueMs: int(env, 'HELIOS_POLL_OVERDUE_MS', 2000, 0, 3_600_000),
    claimCheckIntervalMs: int(env, 'HELIOS_CLAIM_CHECK_INTERVAL_MS', 1000, 50, 600_000),
    reaperIntervalMs: int(env, 'HELIOS_REAPER_INTERVAL_MS', 1000, 50, 600_000),
    responseExcerptBytes: int(env, 'HELIOS_RESPONSE_EXCERPT_BYTES', 2048, 0, 1_048_576),
    dispatchLookaheadMs: int(env, 'HELIOS_DISPATCH_LOOKAHEAD_MS', 5000, 0, 60_000),
    dispatchBatchSize: int(env, 'HELIOS_DISPATCH_BATCH', 500, 1, 10_000),
    misfireThresholdMs: int(env, 'HELIOS_MISFIRE_THRESHOLD_MS', 5000, 0, 86_400_000),
    shutdownTimeoutMs: int(env, 'HELIOS_SHUTDOWN_TIMEOUT_MS', 10_000, 0, 600_000),
    apiTokens,
    metricsPublic: bool(env, 'HELIOS_METRICS_PUBLIC', false),
    targetPolicy: compileTargetPolicy({
      deny: cidrs(env, 'HELIOS_TARGET_DENY'),
      allow: cidrs(env, 'HELIOS_TARGET_ALLOW'),
      defaults: bool(env, 'HELIOS_TARGET_DENY_DEFAULTS', true),
      strict: targetPolicyMode === 'strict',
      cluster,
    }),
    targetPolicyMode,
    sensitiveHeaders: parseSensitiveHeaders(env),
    apiRateLimit: rateLimitOf(env),
    apiBodyLimit: int(env, 'HELIOS_API_BODY_LIMIT', 256 * 1024, 1024, 64 * 1024 * 1024),
    logLevel,
    retention: Object.freeze({
      runsMs: duration(env, 'HELIOS_RUN_RETENTION', 30 * 86_400_000, 1000, 3650 * 86_400_000),
      keepPerJob: int(env, 'HELIOS_RUN_KEEP_PER_JOB', 100, 0, 1_000_000),
      outboxMs: duration(env, 'HELIOS_OUTBOX_RETENTION', 600_000, 0, 30 * 86_400_000),
    }),
    ...isolationOf(env, databasePoolSize),
  };
  return Object.freeze(config);
}

/** The URL at which this node's API is reachable, for the node registry. */
export function apiUrlOf(config: HeliosConfig, boundPort: number): string {
  if (config.publicUrl) return config.publicUrl;
  const host = config.httpHost === '0.0.0.0' || config.httpHost === '::' ? hostname() : config.httpHost;
  return `http://${host.includes(':') ? `[${host}]` : host}:${boundPort}`;
}

/** Settings of the `helios` CLI commands that talk to a node's API. */
export interface CliConfig {
  /** HELIOS_API_URL: base URL of any node's API; default http://127.0.0.1:8080. */
  readonly apiUrl: string;
  /** HELIOS_API_TOKEN: bearer token sent with every request; default none. */
  readonly apiToken: string | undefined;
}

/** Reads the CLI's settings; throws ConfigError naming a bad variable. */
export function loadCliConfig(env: Env = process.env): CliConfig {
  const apiUrl = str(env, 'HELIOS_API_URL', 'http://127.0.0.1:8080').replace(/\/+$/, '');
  const problem = checkUrl(['http:', 'https:'])(apiUrl);
  if (problem) throw new ConfigError('HELIOS_API_URL', problem);
  return Object.freeze({ apiUrl, apiToken: env.HELIOS_API_TOKEN?.trim() || undefined });
}
