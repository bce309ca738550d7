import type { TargetPolicy } from '../security/target-policy.js';

/** What a node does; every node may have any subset. */
export type Role = 'scheduler' | 'worker' | 'api';

export type ApiRole = 'admin' | 'viewer';

/**
 * The validated, defaulted, frozen settings of one node, one section per part (see loadConfig).
 * Each field names its environment variable and default. Only the config module reads `process.env`.
 */
export interface HeliosConfig {
  readonly node: NodeConfig;
  readonly api: ApiConfig;
  readonly database: DatabaseConfig;
  readonly etcd: EtcdConfig;
  readonly kafka: KafkaConfig;
  readonly leader: LeaderConfig;
  readonly worker: WorkerConfig;
  readonly targets: TargetsConfig;
}

export interface NodeConfig {
  /**
   * HELIOS_NODE_ID: unique per node, 1-64 of letters, digits, `.`, `_` and `-`; default
   * `<hostname>-<pid>`, a long hostname cut and followed by a hash of it (defaultNodeId).
   */
  readonly id: string;
  /** HELIOS_ROLES: comma list of scheduler, worker, api; default all three. */
  readonly roles: ReadonlySet<Role>;
  /** HELIOS_LOG_LEVEL: pino level; default info. */
  readonly logLevel: string;
  /**
   * HELIOS_LOG_RUN_LINES_PER_SECOND: at most this many lines about single runs (a failed attempt,
   * a run recovered, a claim lost) a second; the rest are counted in one line a second. Default
   * 100; 0 = no limit.
   */
  readonly logRunLinesPerSecond: number;
  /** HELIOS_SHUTDOWN_TIMEOUT_MS: how long shutdown waits for in-flight runs; default 10000. */
  readonly shutdownTimeoutMs: number;
}

/** The HTTP server: health and metrics on every node, the operator API on nodes with the api role. */
export interface ApiConfig {
  /** HELIOS_HTTP_HOST: address the HTTP server binds; default 127.0.0.1. */
  readonly host: string;
  /** HELIOS_HTTP_PORT: port of the HTTP server (0 = any free port); default 8080. */
  readonly port: number;
  /** HELIOS_PUBLIC_URL: the URL other nodes and tools use to reach this node's API; default from host and port. */
  readonly publicUrl: string | undefined;
  /** HELIOS_API_TOKENS: `token:role` pairs (role admin or viewer), each token 16+ characters and given once. */
  readonly tokens: ReadonlyMap<string, ApiRole>;
  /**
   * HELIOS_API_RATE_LIMIT requests per HELIOS_API_RATE_WINDOW_MS per token (per client address
   * without a valid token), on each node; then 429 with Retry-After. Defaults 6000 per 60000 ms;
   * HELIOS_API_RATE_LIMIT=0 turns the limit off. Null when off.
   */
  readonly rateLimit: { readonly max: number; readonly windowMs: number } | null;
  /** HELIOS_API_BODY_LIMIT: largest accepted API request body in bytes; default 262144 (256 KiB). */
  readonly bodyLimit: number;
  /** HELIOS_METRICS_PUBLIC: `true` serves /metrics without a token even when tokens are configured; default false. */
  readonly metricsPublic: boolean;
}

export interface DatabaseConfig {
  /** HELIOS_DATABASE_URL: PostgreSQL connection string (required). */
  readonly url: string;
  /** HELIOS_DATABASE_POOL_SIZE: connections in this node's pool; default 20. */
  readonly poolSize: number;
}

export interface EtcdConfig {
  /** HELIOS_ETCD_ENDPOINTS: comma list of etcd client URLs (required). */
  readonly endpoints: readonly string[];
  /** HELIOS_ETCD_PREFIX: key prefix for the leader key and node registry; default `/helios`. */
  readonly prefix: string;
}

export interface KafkaConfig {
  /** HELIOS_KAFKA_BROKERS: comma list of host:port, an IPv6 address in brackets, port 1-65535 (required). */
  readonly brokers: readonly string[];
  /** HELIOS_KAFKA_TOPIC: dispatch topic (Kafka's topic name rules); default `helios.runs`. */
  readonly runsTopic: string;
  /**
   * HELIOS_KAFKA_DLQ_TOPIC: dead-letter topic (Kafka's topic name rules), not HELIOS_KAFKA_TOPIC
   * even with `.` and `_` taken as the same; default `helios.runs.dlq`.
   */
  readonly deadLetterTopic: string;
  /** HELIOS_KAFKA_PARTITIONS: partitions of the runs topic when creating it (the dead-letter topic gets 1); default 6. */
  readonly partitions: number;
  /**
   * HELIOS_KAFKA_REPLICATION_FACTOR: replicas of each topic when a node creates the topics; default 1
   * (a single broker). A cluster of 3 or more brokers wants 3, with the broker's
   * `min.insync.replicas` at 2 (the publisher uses acks=all). An existing topic is left as it is.
   */
  readonly replicationFactor: number;
  /** HELIOS_KAFKA_GROUP: consumer group of the workers (1-249 characters, no control characters); default `helios-workers`. */
  readonly consumerGroup: string;
}

/** The elected leader's work: election, dispatch, reaping, pruning, the cluster signals. */
export interface LeaderConfig {
  /** HELIOS_LEASE_TTL_MS: leader lease TTL (rounded up to whole seconds for etcd); default 3000. */
  readonly leaseTtlMs: number;
  /** HELIOS_LEADER_SAFETY_MARGIN_MS: a leader stops this long before its lease could expire; default 500. */
  readonly safetyMarginMs: number;
  /**
   * HELIOS_DISPATCH_LOOKAHEAD_MS: runs are created (and published) up to this long before they are
   * due, so workers hold them and fire on time; default 5500, enough to create a herd of 10,000
   * jobs due in the same second before it is due on 2 cores, and half a second off the whole seconds
   * occurrences fall on (DEFAULT_DISPATCH_LOOKAHEAD_MS in config/index.ts). An edit of a job through the API
   * withdraws its runs created ahead (see PATCH /jobs/{id}).
   */
  readonly lookaheadMs: number;
  /**
   * HELIOS_MISFIRE_THRESHOLD_MS: an occurrence found this late is a misfire (handled by the job's
   * `misfire` policy); default 5000. The API's job commands judge due occurrences the same way.
   */
  readonly misfireThresholdMs: number;
  /** HELIOS_DISPATCH_BATCH: jobs per dispatch transaction; default 500. */
  readonly batchSize: number;
  /**
   * HELIOS_LEADER_POOL_SIZE: connections of the leader's own pool (dispatcher, outbox relay,
   * reaper, pruner, cluster gauges), opened only while the node leads, in addition to
   * HELIOS_DATABASE_POOL_SIZE; default 5 (one per leader loop).
   */
  readonly poolSize: number;
  /** HELIOS_REAPER_INTERVAL_MS: longest pause between the leader's passes over expired claims; default 1000. */
  readonly reaperIntervalMs: number;
  /**
   * HELIOS_LEADER_STALL_MS: a leader none of whose dispatch passes PostgreSQL answered for this
   * long probes it on a new connection, and steps down (for as long again) when that fails too or
   * finds none of its sessions at work there, so that a node that can use the database leads;
   * default 4000 (see coordination/leader-stall.ts). With the default lookahead and misfire
   * threshold, a leader cut off from PostgreSQL is replaced before an occurrence misfires.
   */
  readonly stallMs: number;
  /** HELIOS_SIGNALS_INTERVAL_MS: how often the leader refreshes the cluster gauges (queues, dead letters, Kafka lag); default 5000. */
  readonly signalsIntervalMs: number;
  /** Retention of history, applied by the leader's pruner. */
  readonly retention: RetentionConfig;
}

export interface RetentionConfig {
  /** HELIOS_RUN_RETENTION: finished runs (with attempts and resolved dead letters) older than this are deleted; default 30d. */
  readonly runsMs: number;
  /** HELIOS_RUN_KEEP_PER_JOB: the newest runs of each job kept whatever their age; default 100. */
  readonly keepPerJob: number;
  /** HELIOS_OUTBOX_RETENTION: published outbox rows are deleted after this; default 10m. */
  readonly outboxMs: number;
}

/** The worker's tunables (the worker role). */
export interface WorkerConfig {
  /**
   * HELIOS_WORKER_CONCURRENCY: HTTP calls in flight at once on this node (execution slots; claims
   * take none: see execution/run-queue.ts); default 64.
   */
  readonly concurrency: number;
  /**
   * HELIOS_WORKER_PREFETCH: run announcements a worker holds in memory until they are due (the
   * dispatcher publishes runs up to the lookahead early); fetching from Kafka pauses at this many;
   * default 5000 (a few kilobytes each).
   */
  readonly prefetch: number;
  /**
   * HELIOS_CLAIM_GRACE_MS: a claim's deadline is the later of now and the run's not_before + the
   * run's timeout + this; a claimed run must get its execution slot within it; default 5000.
   */
  readonly claimGraceMs: number;
  /**
   * HELIOS_CLOCK_SKEW_TOLERANCE_MS: a worker may claim a run this long before its not_before by
   * the database clock, absorbing the error of its clock estimate; default 10.
   */
  readonly skewToleranceMs: number;
  /**
   * HELIOS_CLAIM_LEAD_MS: a worker claims an `allow` run up to this long before it is due and
   * starts the HTTP call exactly when due, so a herd's claims are made before it is due (forbid and
   * replace runs are claimed only when due). A run claimed ahead is marked started just before its
   * call; until then a pause or an edit withdraws it. Default 750 (see DEFAULT_CLAIM_LEAD_MS).
   */
  readonly claimLeadMs: number;
  /**
   * HELIOS_MISFIRE_THRESHOLD_MS (the leader's too): a run a leader made before an outage (its epoch
   * has ended since) that no worker claimed until this long after it was due is a misfire, which
   * its job's policy may drop at the claim (store/runs.ts misfiredAtClaim); default 5000.
   */
  readonly misfireThresholdMs: number;
  /** HELIOS_POLL_INTERVAL_MS: period of the workers' polling fallback; default 1000. */
  readonly pollIntervalMs: number;
  /** HELIOS_POLL_OVERDUE_MS: the polling fallback claims queued runs this overdue; default 2000. */
  readonly pollOverdueMs: number;
  /** HELIOS_CLAIM_CHECK_INTERVAL_MS: how often a worker checks that it still holds its claims; default 1000. */
  readonly claimCheckIntervalMs: number;
  /** HELIOS_RESPONSE_EXCERPT_BYTES: bytes of a target's response body kept per attempt; default 2048. */
  readonly maxExcerptBytes: number;
  /**
   * HELIOS_COMPLETION_HOLD_MS: how long a success's write may be held back while this worker has
   * a backlog of calls (RunQueue.callsUnderway, execution/batching.ts); 0 writes each at once;
   * default 2000.
   */
  readonly completionHoldMs: number;
  /**
   * HELIOS_WORKER_DB_CONNECTIONS: connections of the node's pool the worker may use at once for its
   * runs (claims, completions, retries); below HELIOS_DATABASE_POOL_SIZE so the API and readiness
   * always find one; default three quarters of the pool (15 of 20; at least 1).
   */
  readonly dbConnections: number;
}

/** Where job targets may point, and which of their headers are secret. */
export interface TargetsConfig {
  /**
   * Checked when a job is saved and again, after DNS, when it is executed. Deny wins over allow.
   * Settings:
   * - HELIOS_TARGET_DENY: CIDR ranges refused in addition to the defaults (link-local, cloud
   *   metadata addresses, "this host"); default none.
   * - HELIOS_TARGET_DENY_DEFAULTS: `false` drops those defaults (only for a network without a
   *   metadata service); default true.
   * - HELIOS_TARGET_POLICY: `strict` also refuses loopback and private ranges (recommended in
   *   production); default `permissive`.
   * - HELIOS_TARGET_ALLOW: CIDR ranges allowed exclusively; default empty (all not denied).
   * The configured etcd, Kafka and PostgreSQL endpoints and every node's API are always refused
   * (`policy.cluster`; the node adds its own API address and the registry's once started).
   */
  readonly policy: TargetPolicy;
  /** HELIOS_TARGET_POLICY: `strict` or `permissive` (see policy). */
  readonly mode: 'strict' | 'permissive';
  /** HELIOS_SENSITIVE_HEADERS: header names added to authorization, cookie, proxy-authorization, x-api-key, whose values show as `***`. */
  readonly sensitiveHeaders: ReadonlySet<string>;
}
