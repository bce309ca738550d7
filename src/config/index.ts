// The node's and the CLI's configuration: environment → validated, defaulted, frozen sections.
// The only module that reads `process.env`; sections.ts documents every variable.
import { createHash } from 'node:crypto';
import { hostname } from 'node:os';
import { CidrRange, compileTargetPolicy, InvalidCidrError } from '../security/target-policy.js';
import { ClusterEndpoints, configuredEndpoints } from '../security/cluster-endpoints.js';
import { sensitiveHeaderSet } from '../security/sensitive-headers.js';
import {
  bool,
  checkHostPort,
  checkUrl,
  ConfigError,
  duration,
  int,
  items,
  kafkaName,
  list,
  oneOf,
  optional,
  str,
  type Env,
} from './env.js';
import type {
  ApiConfig,
  ApiRole,
  DatabaseConfig,
  EtcdConfig,
  HeliosConfig,
  KafkaConfig,
  LeaderConfig,
  NodeConfig,
  Role,
  TargetsConfig,
  WorkerConfig,
} from './sections.js';

export { ConfigError, type Env } from './env.js';
export type * from './sections.js';

const ROLES: readonly Role[] = ['scheduler', 'worker', 'api'];
const LOG_LEVELS = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'];

/**
 * HELIOS_WORKER_CONCURRENCY's default: HTTP calls in flight at once per node. 128 ended a warm herd
 * of 10,000 on three nodes ≈5 % sooner here, but doubles the calls each node may have open at one
 * target (whose own queue counts against the run's timeout), so the default stays 64; see
 * docs/performance.md.
 */
export const DEFAULT_WORKER_CONCURRENCY = 64;

/**
 * Cron occurrences fall on whole seconds, and so do the calls they make. The leader dispatches runs
 * a lookahead before they are due: with a whole number of seconds, the dispatch of a later second
 * (and its announcements, and the workers taking them in) lands on the very millisecond of this
 * second's calls. Half a second more puts it between two seconds' calls: at 500 every-second
 * runs/s on two cores, p99 lateness 100 and 104 ms against 139–150 ms (p50 47–49 against 58–68)
 * for the same CPU per run (docs/performance.md, 2026-12-06).
 */
export const DEFAULT_DISPATCH_LOOKAHEAD_MS = 5500;
/**
 * HELIOS_CLAIM_LEAD_MS's default. For the reason the lookahead is not a whole number of seconds:
 * with a lead of 1000 the claims of the next second's runs were made on the very millisecond of
 * this second's calls. At 750 they come a quarter of a second after them and a quarter before the
 * dispatch (5.5 s ahead). Interleaved on two cores: p99 lateness at 500 every-second runs/s 86–89
 * against 111–154 ms, p50 at 2,000 runs/s 109–124 against 184–201 ms; the herd and the throughput
 * at 5,000/s the same within the noise (docs/performance.md, 2026-12-06, morning).
 */
export const DEFAULT_CLAIM_LEAD_MS = 750;

/** Validates and freezes the configuration; throws ConfigError naming the first bad variable. */
export function loadConfig(env: Env = process.env): HeliosConfig {
  const leader = leaderConfig(env);
  const node = nodeConfig(env);
  const database = databaseConfig(env);
  const api = apiConfig(env);
  const etcd = etcdConfig(env);
  const kafka = kafkaConfig(env);
  return Object.freeze({
    node,
    api,
    database,
    etcd,
    kafka,
    leader,
    worker: workerConfig(env, database.poolSize),
    targets: targetsConfig(env, { api, database, etcd, kafka }),
  });
}

/** What a node id may be (it names etcd keys, PostgreSQL sessions and metrics). */
const NODE_ID = /^[A-Za-z0-9._-]{1,64}$/;

/**
 * HELIOS_NODE_ID's default, `<hostname>-<pid>`, always within the node id's rule: when the
 * hostname has other characters or is too long for it, they become "-" and the name is cut, with
 * a hash of the whole hostname before the pid. The hash keeps apart hosts whose long names differ
 * only at the end (a StatefulSet's or Deployment's pods, whose process is often pid 1).
 */
export function defaultNodeId(host: string, pid: number): string {
  const plain = `${host}-${pid}`;
  if (NODE_ID.test(plain)) return plain;
  const suffix = `-${createHash('sha256').update(host).digest('hex').slice(0, 8)}-${pid}`;
  return host.replace(/[^A-Za-z0-9._-]/g, '-').slice(0, 64 - suffix.length) + suffix;
}

function nodeConfig(env: Env): NodeConfig {
  const id = str(env, 'HELIOS_NODE_ID', defaultNodeId(hostname(), process.pid));
  if (!NODE_ID.test(id)) {
    throw new ConfigError('HELIOS_NODE_ID', 'must be 1-64 characters of letters, digits, ".", "_" or "-"');
  }
  const logLevel = str(env, 'HELIOS_LOG_LEVEL', 'info');
  if (!LOG_LEVELS.includes(logLevel))
    throw new ConfigError('HELIOS_LOG_LEVEL', `unknown level "${logLevel}"`);
  return Object.freeze({
    id,
    roles: parseRoles(env),
    logLevel,
    logRunLinesPerSecond: int(env, 'HELIOS_LOG_RUN_LINES_PER_SECOND', 100, 0, 1_000_000),
    shutdownTimeoutMs: int(env, 'HELIOS_SHUTDOWN_TIMEOUT_MS', 10_000, 0, 600_000),
  });
}

function parseRoles(env: Env): Set<Role> {
  const roles = new Set<Role>();
  for (const item of (env.HELIOS_ROLES?.trim() || ROLES.join(',')).split(',').map((s) => s.trim())) {
    if (!ROLES.includes(item as Role)) {
      throw new ConfigError('HELIOS_ROLES', `unknown role "${item}" (expected ${ROLES.join(', ')})`);
    }
    roles.add(item as Role);
  }
  return roles;
}

function apiConfig(env: Env): ApiConfig {
  const publicUrl = optional(env, 'HELIOS_PUBLIC_URL');
  if (publicUrl) {
    const problem = checkUrl(['http:', 'https:'])(publicUrl);
    if (problem) throw new ConfigError('HELIOS_PUBLIC_URL', problem);
  }
  const host = str(env, 'HELIOS_HTTP_HOST', '127.0.0.1');
  const tokens = parseTokens(env);
  // Without tokens the API is open to whoever reaches it, so it must stay on this host.
  if (tokens.size === 0 && !isLoopbackHost(host)) {
    throw new ConfigError(
      'HELIOS_HTTP_HOST',
      `binding "${host}" requires HELIOS_API_TOKENS; without tokens only a loopback address is allowed`,
    );
  }
  const rateMax = int(env, 'HELIOS_API_RATE_LIMIT', 6000, 0, 10_000_000);
  const rateWindowMs = int(env, 'HELIOS_API_RATE_WINDOW_MS', 60_000, 100, 3_600_000);
  return Object.freeze({
    host,
    port: int(env, 'HELIOS_HTTP_PORT', 8080, 0, 65535),
    publicUrl,
    tokens,
    rateLimit: rateMax === 0 ? null : Object.freeze({ max: rateMax, windowMs: rateWindowMs }),
    bodyLimit: int(env, 'HELIOS_API_BODY_LIMIT', 256 * 1024, 1024, 64 * 1024 * 1024),
    metricsPublic: bool(env, 'HELIOS_METRICS_PUBLIC', false),
  });
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
    // A repeated token would silently take the role of its last entry (a viewer may be meant).
    const first = [...tokens.keys()].indexOf(token);
    if (first >= 0) {
      throw new ConfigError(
        'HELIOS_API_TOKENS',
        `entry ${index + 1} repeats the token of entry ${first + 1}`,
      );
    }
    tokens.set(token, role);
  }
  return tokens;
}

/** True for addresses only this host can reach. */
export function isLoopbackHost(host: string): boolean {
  const bare = host.replace(/^\[(.*)\]$/, '$1').toLowerCase();
  return bare === 'localhost' || bare === '::1' || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(bare);
}

function databaseConfig(env: Env): DatabaseConfig {
  const url = str(env, 'HELIOS_DATABASE_URL');
  const problem = checkUrl(['postgres:', 'postgresql:'])(url);
  if (problem) throw new ConfigError('HELIOS_DATABASE_URL', problem);
  return Object.freeze({ url, poolSize: int(env, 'HELIOS_DATABASE_POOL_SIZE', 20, 2, 500) });
}

function etcdConfig(env: Env): EtcdConfig {
  const prefix = str(env, 'HELIOS_ETCD_PREFIX', '/helios').replace(/\/+$/, '');
  if (!prefix.startsWith('/')) throw new ConfigError('HELIOS_ETCD_PREFIX', 'must start with "/"');
  return Object.freeze({
    endpoints: list(env, 'HELIOS_ETCD_ENDPOINTS', checkUrl(['http:', 'https:'])),
    prefix,
  });
}

/**
 * HELIOS_KAFKA_GROUP: Kafka takes any group id, so only what no operator means is refused (nothing,
 * control characters, an id longer than a topic name may be), not a topic name's rules.
 */
function consumerGroup(env: Env): string {
  const value = str(env, 'HELIOS_KAFKA_GROUP', 'helios-workers');
  // eslint-disable-next-line no-control-regex
  if (value.length === 0 || value.length > 249 || /[\u0000-\u001f\u007f]/.test(value)) {
    throw new ConfigError('HELIOS_KAFKA_GROUP', 'must be 1-249 characters, none of them control characters');
  }
  return value;
}

function kafkaConfig(env: Env): KafkaConfig {
  const runsTopic = kafkaName(env, 'HELIOS_KAFKA_TOPIC', 'helios.runs');
  const deadLetterTopic = kafkaName(env, 'HELIOS_KAFKA_DLQ_TOPIC', 'helios.runs.dlq');
  // Kafka takes "." and "_" as the same in a topic's metric names and refuses a topic that collides
  // with another that way; the same topic for both would put dead letters among the runs.
  const collides = (topic: string) => topic.replaceAll('.', '_');
  if (collides(deadLetterTopic) === collides(runsTopic)) {
    throw new ConfigError(
      'HELIOS_KAFKA_DLQ_TOPIC',
      `must differ from HELIOS_KAFKA_TOPIC ("${runsTopic}"), also with "." and "_" taken as the same`,
    );
  }
  return Object.freeze({
    brokers: list(env, 'HELIOS_KAFKA_BROKERS', checkHostPort),
    runsTopic,
    deadLetterTopic,
    partitions: int(env, 'HELIOS_KAFKA_PARTITIONS', 6, 1, 1000),
    replicationFactor: int(env, 'HELIOS_KAFKA_REPLICATION_FACTOR', 1, 1, 32),
    consumerGroup: consumerGroup(env),
  });
}

/** HELIOS_MISFIRE_THRESHOLD_MS: the leader's dispatch and the workers' claims judge lateness by it. */
function misfireThresholdMs(env: Env): number {
  return int(env, 'HELIOS_MISFIRE_THRESHOLD_MS', 5000, 0, 86_400_000);
}

function leaderConfig(env: Env): LeaderConfig {
  const leaseTtlMs = int(env, 'HELIOS_LEASE_TTL_MS', 3000, 2000, 60_000);
  const safetyMarginMs = int(env, 'HELIOS_LEADER_SAFETY_MARGIN_MS', 500, 100, 10_000);
  if (safetyMarginMs >= leaseTtlMs / 2) {
    throw new ConfigError('HELIOS_LEADER_SAFETY_MARGIN_MS', `must be less than half of HELIOS_LEASE_TTL_MS`);
  }
  return Object.freeze({
    leaseTtlMs,
    safetyMarginMs,
    lookaheadMs: int(env, 'HELIOS_DISPATCH_LOOKAHEAD_MS', DEFAULT_DISPATCH_LOOKAHEAD_MS, 0, 60_000),
    misfireThresholdMs: misfireThresholdMs(env),
    batchSize: int(env, 'HELIOS_DISPATCH_BATCH', 500, 1, 10_000),
    poolSize: int(env, 'HELIOS_LEADER_POOL_SIZE', 5, 1, 100),
    reaperIntervalMs: int(env, 'HELIOS_REAPER_INTERVAL_MS', 1000, 50, 600_000),
    stallMs: int(env, 'HELIOS_LEADER_STALL_MS', 4000, 1000, 600_000),
    // At most a minute: HeliosClusterGaugesStale calls a reading older than 3 minutes stale, and the
    // outbox and overdue alerts read these gauges; a 10-minute interval fired the first for ever.
    signalsIntervalMs: int(env, 'HELIOS_SIGNALS_INTERVAL_MS', 5000, 100, 60_000),
    retention: Object.freeze({
      runsMs: duration(env, 'HELIOS_RUN_RETENTION', 30 * 86_400_000, 1000, 3650 * 86_400_000),
      keepPerJob: int(env, 'HELIOS_RUN_KEEP_PER_JOB', 100, 0, 1_000_000),
      outboxMs: duration(env, 'HELIOS_OUTBOX_RETENTION', 600_000, 0, 30 * 86_400_000),
    }),
  });
}

/** The worker's share of the node's pool must leave one connection to the API and readiness. */
function workerConfig(env: Env, databasePoolSize: number): WorkerConfig {
  return Object.freeze({
    concurrency: int(env, 'HELIOS_WORKER_CONCURRENCY', DEFAULT_WORKER_CONCURRENCY, 1, 10_000),
    prefetch: int(env, 'HELIOS_WORKER_PREFETCH', 5000, 1, 100_000),
    claimGraceMs: int(env, 'HELIOS_CLAIM_GRACE_MS', 5000, 100, 3_600_000),
    skewToleranceMs: int(env, 'HELIOS_CLOCK_SKEW_TOLERANCE_MS', 10, 0, 10_000),
    claimLeadMs: int(env, 'HELIOS_CLAIM_LEAD_MS', DEFAULT_CLAIM_LEAD_MS, 0, 10_000),
    misfireThresholdMs: misfireThresholdMs(env),
    pollIntervalMs: int(env, 'HELIOS_POLL_INTERVAL_MS', 1000, 50, 600_000),
    pollOverdueMs: int(env, 'HELIOS_POLL_OVERDUE_MS', 2000, 0, 3_600_000),
    claimCheckIntervalMs: int(env, 'HELIOS_CLAIM_CHECK_INTERVAL_MS', 1000, 50, 600_000),
    maxExcerptBytes: int(env, 'HELIOS_RESPONSE_EXCERPT_BYTES', 2048, 0, 1_048_576),
    completionHoldMs: int(env, 'HELIOS_COMPLETION_HOLD_MS', 2000, 0, 10_000),
    dbConnections: int(
      env,
      'HELIOS_WORKER_DB_CONNECTIONS',
      Math.max(1, Math.floor((databasePoolSize * 3) / 4)),
      1,
      databasePoolSize - 1,
    ),
  });
}

/** The target policy also refuses the cluster's own servers, so it needs their addresses. */
function targetsConfig(
  env: Env,
  servers: { api: ApiConfig; database: DatabaseConfig; etcd: EtcdConfig; kafka: KafkaConfig },
): TargetsConfig {
  const mode = oneOf(env, 'HELIOS_TARGET_POLICY', ['strict', 'permissive'], 'permissive');
  const { api, database, etcd, kafka } = servers;
  const cluster = new ClusterEndpoints(
    configuredEndpoints(
      etcd.endpoints,
      kafka.brokers,
      database.url,
      {
        host: api.host,
        port: api.port,
        publicUrl: api.publicUrl,
      },
      { host: env.PGHOST, port: env.PGPORT },
    ),
  );
  const sensitive = items(env, 'HELIOS_SENSITIVE_HEADERS');
  const bad = sensitive.find((h) => !/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(h));
  if (bad !== undefined) throw new ConfigError('HELIOS_SENSITIVE_HEADERS', `"${bad}" is not a header name`);
  return Object.freeze({
    policy: compileTargetPolicy({
      deny: cidrs(env, 'HELIOS_TARGET_DENY'),
      allow: cidrs(env, 'HELIOS_TARGET_ALLOW'),
      defaults: bool(env, 'HELIOS_TARGET_DENY_DEFAULTS', true),
      strict: mode === 'strict',
      cluster,
    }),
    mode,
    sensitiveHeaders: sensitiveHeaderSet(sensitive),
  });
}

/** A comma list of CIDR ranges; [] when unset or `none`. */
function cidrs(env: Env, name: string): string[] {
  if (env[name]?.trim().toLowerCase() === 'none') return [];
  const ranges = items(env, name);
  for (const range of ranges) {
    try {
      CidrRange.parse(range);
    } catch (err) {
      if (err instanceof InvalidCidrError) throw new ConfigError(name, err.message);
      throw err;
    }
  }
  return ranges;
}

/** The URL at which this node's API is reachable, for the node registry. */
export function apiUrlOf(api: ApiConfig, boundPort: number): string {
  if (api.publicUrl) return api.publicUrl;
  const host = api.host === '0.0.0.0' || api.host === '::' ? hostname() : api.host;
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
  // fetch refuses such a URL, and every message that names the API would print the password.
  const { username, password } = new URL(apiUrl);
  if (username || password)
    throw new ConfigError(
      'HELIOS_API_URL',
      'must not carry credentials (user:password@); use HELIOS_API_TOKEN',
    );
  return Object.freeze({ apiUrl, apiToken: optional(env, 'HELIOS_API_TOKEN') });
}
