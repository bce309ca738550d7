import { hostname } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import type { FastifyInstance } from 'fastify';
import type { Etcd3 } from 'etcd3';
import type { RunMessage } from './model.js';
import { apiUrlOf, type HeliosConfig } from './config/index.js';
import { LifecycleError, toError, withTimeout } from './errors.js';
import { createLogger, type Logger } from './observability/logger.js';
import { RunLines } from './observability/run-lines.js';
import { createMetrics, type Metrics } from './observability/metrics.js';
import { createPool, ping, type Database } from './store/db.js';
import { PoolShare, poolStats } from './store/pool-share.js';
import { migrate } from './store/migrate.js';
import { Notifications } from './store/notifications.js';
import { handOffRuns, peersOrEveryone, workersBut } from './store/handoff.js';
import {
  endPredecessorSessions,
  leaderApplicationName,
  probeLeaderSessions,
} from './store/leader-sessions.js';
import { createEtcdClient } from './coordination/etcd.js';
import { EndedEpochs } from './coordination/ended-epochs.js';
import type { EndedEpochsReading } from './store/runs.js';
import { listNodes, NodeRegistry } from './coordination/registry.js';
import { clusterView } from './coordination/cluster-view.js';
import { endpointOfUrl, endpointsOfEtcdMembers, type Endpoint } from './security/cluster-endpoints.js';
import { LeaderElection, type Leadership } from './coordination/election.js';
import { LeaderStallWatch } from './coordination/leader-stall.js';
import {
  consumerGroupLag,
  createKafka,
  nodeTopics,
  RunPublisher,
  TopicProvisioner,
  type BrokerClient,
} from './broker/index.js';
import { ClusterSignals } from './observability/cluster-signals.js';
import { KafkaProbe } from './broker/health.js';
import { Dispatcher } from './scheduling/dispatcher.js';
import { OutboxRelay } from './outbox/relay.js';
import { Worker } from './execution/worker.js';
import { Reaper, UnstartedClaimsHold } from './execution/reaper.js';
import { Pruner } from './retention/pruner.js';
import { buildApiServer, listenOn } from './api/server.js';
import { registerApi } from './api/v1.js';

type State = 'idle' | 'starting' | 'running' | 'stopping' | 'stopped';

/** How often the node re-reads the registry and re-resolves the cluster's endpoint names. */
const CLUSTER_ENDPOINTS_REFRESH_MS = 10_000;

/**
 * How long the leader's stall probe may take to connect to PostgreSQL and be answered. A longer
 * one tolerates a server slower to open sessions and delays the handover of a cut-off leader.
 */
const STALL_PROBE_TIMEOUT_MS = 3000;

export interface HeliosNodeOptions {
  readonly config: HeliosConfig;
  /** Default: a pino logger on stdout at `config.node.logLevel`. */
  readonly logger?: Logger;
  /** Fault injection for fence tests; see DispatcherOptions.beforeWrite. */
  readonly beforeLeaderWrite?: () => Promise<void>;
  /** Fault injection for outbox tests; see OutboxRelayOptions.beforePublish. */
  readonly beforePublish?: () => Promise<void>;
  /**
   * Fault injection for takeover tests: awaited once an epoch began and before it ends its
   * predecessor's sessions, where a pause right after winning would hurt most.
   */
  readonly beforeTakeover?: () => Promise<void>;
}

/**
 * One Helios node: composes the parts its roles need and starts/stops them in order.
 * Parts stop in reverse order of start; each cleanup runs on its own, failures are collected.
 */
export class HeliosNode {
  readonly config: HeliosConfig;
  readonly logger: Logger;
  readonly metrics: Metrics;
  /** Lines about single runs, shared by the worker and the reaper (HELIOS_LOG_RUN_LINES_PER_SECOND). */
  private readonly runLines: RunLines;
  private state: State = 'idle';
  private starting?: Promise<void>;
  private stopping?: Promise<void>;
  private readonly cleanups: { name: string; run: () => Promise<void> }[] = [];
  private pool?: Database;
  /** The leader loops' own pool (scheduler role): dispatch never queues behind runs or the API. */
  private leaderPool?: Database;
  private etcd?: Etcd3;
  private kafka?: BrokerClient;
  private notifications?: Notifications;
  private publisher?: RunPublisher;
  private topics?: TopicProvisioner;
  private election?: LeaderElection;
  private app?: FastifyInstance;
  private leaderTasks = new Set<Promise<void>>();
  /** The reaper's hold of never-started claims, kept across this node's epochs. */
  private readonly unstartedHold = new UnstartedClaimsHold();
  private _apiUrl: string | null = null;

  constructor(private readonly options: HeliosNodeOptions) {
    this.config = options.config;
    this.logger =
      options.logger ??
      createLogger({
        level: options.config.node.logLevel,
        nodeId: options.config.node.id,
        sensitiveHeaders: options.config.targets.sensitiveHeaders,
      });
    this.metrics = createMetrics(options.config.node.id);
    this.runLines = new RunLines(this.logger, options.config.node.logRunLinesPerSecond);
  }

  /** The URL of this node's HTTP server once started (null without the api role's server). */
  get apiUrl(): string | null {
    return this._apiUrl;
  }

  /** The current leadership epoch, if this node leads. */
  leadership(): Leadership | null {
    return this.election?.current() ?? null;
  }

  start(): Promise<void> {
    if (this.state !== 'idle')
      return this.starting ?? Promise.reject(new LifecycleError(`node is ${this.state}`));
    this.state = 'starting';
    this.starting = this.startParts().then(
      () => {
        this.state = 'running';
      },
      async (err: unknown) => {
        // A node that could not start releases whatever it had opened.
        await this.stop().catch(() => undefined);
        throw toError(err);
      },
    );
    return this.starting;
  }

  private onStop(name: string, run: () => Promise<void> | void) {
    this.cleanups.push({ name, run: async () => run() });
  }

  private async startParts(): Promise<void> {
    const { config, logger } = this;
    logger.info({ roles: [...config.node.roles] }, 'starting node');
    // Registered first, so it runs last: what the parts' last lines left out is said.
    this.onStop('run log lines', () => this.runLines.flush());

    const pool = (this.pool = createPool({
      connectionString: config.database.url,
      max: config.database.poolSize,
      logger,
      applicationName: `helios-${config.node.id}`,
    }));
    this.onStop('postgres pool', () => pool.end());
    this.metrics.trackPool('main', poolStats(pool, config.database.poolSize));
    this.onStop('pool sampling', () => this.metrics.stopPoolSampling());
    const applied = await migrate(pool);
    if (applied.length > 0) logger.info({ applied }, 'applied migrations');

    const notifications = (this.notifications = new Notifications(
      config.database.url,
      ['helios_jobs', 'helios_outbox', 'helios_runs', 'helios_handoff'],
      logger,
    ));
    notifications.start();
    this.onStop('notifications', () => notifications.stop());

    const etcd = (this.etcd = createEtcdClient(config.etcd.endpoints));
    this.onStop('etcd client', () => etcd.close());

    const kafka = (this.kafka = createKafka({
      brokers: [...config.kafka.brokers],
      clientId: config.node.id,
      logger,
    }));
    const probe = new KafkaProbe(kafka);
    this.onStop('kafka probe', () => probe.close());
    // Not awaited: a node starts while Kafka is down (workers execute through the polling
    // fallback, the API needs no Kafka); the relay waits for the topics, the consumer retries.
    const topics = (this.topics = new TopicProvisioner({
      kafka,
      topics: nodeTopics(config.kafka),
      logger,
    }));
    topics.start();
    this.onStop('kafka topics', () => topics.stop());

    const app = (this.app = await buildApiServer({
      logger,
      metrics: this.metrics.registry,
      // Only PostgreSQL is required for readiness; etcd and Kafka outages degrade the node (the
      // body names them) without taking it out of service. See registerHealthRoutes.
      probes: {
        postgres: { required: true, check: () => ping(pool) },
        etcd: {
          required: false,
          check: async () => void (await etcd.get(`${config.etcd.prefix}/readyz`).string()),
        },
        kafka: {
          required: false,
          check: async () => {
            topics.check();
            await probe.check();
          },
        },
      },
      bodyLimit: config.api.bodyLimit,
      // Any node with the api role serves the operator API (writes go to PostgreSQL); the others
      // serve only health, readiness and (token-checked) metrics.
      register: (server) =>
        registerApi(server, {
          pool,
          cluster: clusterView(etcd, config.etcd.prefix),
          runsTopic: config.kafka.runsTopic,
          misfireThresholdMs: config.leader.misfireThresholdMs,
          tokens: config.api.tokens,
          targetPolicy: config.targets.policy,
          sensitiveHeaders: config.targets.sensitiveHeaders,
          metricsPublic: config.api.metricsPublic,
          ...(config.api.rateLimit ? { rateLimit: config.api.rateLimit } : {}),
          routes: config.node.roles.has('api'),
          logger,
        }),
    }));
    if (config.api.tokens.size === 0) {
      // loadConfig refused any non-loopback HELIOS_HTTP_HOST without tokens.
      logger.warn(
        { host: config.api.host },
        'HELIOS_API_TOKENS is empty: the API is open to every local user; binding loopback only',
      );
    }
    await listenOn(app, config.api);
    this.onStop('http server', () => app.close());
    const address = app.server.address();
    const port = typeof address === 'object' && address ? address.port : config.api.port;
    this._apiUrl = apiUrlOf(config.api, port);
    await this.watchClusterEndpoints(etcd, probe, { host: config.api.host, port, what: 'node API' });

    const registry = new NodeRegistry({
      client: etcd,
      prefix: config.etcd.prefix,
      info: {
        id: config.node.id,
        host: hostname(),
        pid: process.pid,
        apiUrl: this._apiUrl,
        roles: [...config.node.roles],
      },
      logger,
    });
    await registry.start();
    this.onStop('node registration', () => registry.stop());

    if (config.node.roles.has('worker')) {
      // The worker's runs use at most this share of the pool: a herd of settling attempts waits
      // here, and the API and readiness probe keep their connections.
      const share = new PoolShare(pool, config.worker.dbConnections);
      this.metrics.trackPool('worker', share);
      const worker = new Worker({
        pool: share,
        kafka,
        notifications,
        nodeId: config.node.id,
        runsTopic: config.kafka.runsTopic,
        deadLetterTopic: config.kafka.deadLetterTopic,
        consumerGroup: config.kafka.consumerGroup,
        settings: config.worker,
        // The node gives each part shutdownTimeoutMs; keep a second of it for aborting and
        // handing back the claims of calls that did not finish.
        drainTimeoutMs: Math.max(0, config.node.shutdownTimeoutMs - 1000),
        targetPolicy: config.targets.policy,
        // The registry's live workers but this one; bounded, as a stop waits for it.
        handOffPeers: () => this.liveWorkersBut(config.node.id),
        endedEpochs: await this.watchEndedEpochs(etcd),
        logger,
        runLines: this.runLines,
        metrics: this.metrics,
      });
      await worker.start();
      this.onStop('worker', () => worker.stop());
    }

    if (config.node.roles.has('scheduler')) {
      // Opens connections only when used, i.e. while this node leads; ended after the leader tasks.
      const leaderPool = (this.leaderPool = createPool({
        connectionString: config.database.url,
        max: config.leader.poolSize,
        logger,
        applicationName: leaderApplicationName(config.node.id),
      }));
      this.onStop('leader postgres pool', () => leaderPool.end());
      this.metrics.trackPool('leader', poolStats(leaderPool, config.leader.poolSize));
      const publisher = (this.publisher = new RunPublisher({ kafka, logger }));
      this.onStop('kafka publisher', () => publisher.disconnect());
      // Connect early so a wrong broker address shows at start; publish() reconnects by itself.
      // Not awaited: with Kafka down it would hold the start for the connect timeout.
      void publisher
        .connect()
        .catch((err: unknown) => logger.warn({ err: toError(err) }, 'publisher connect failed'));
      const election = (this.election = new LeaderElection({
        client: etcd,
        key: `${config.etcd.prefix}/leader`,
        nodeId: config.node.id,
        ttlMs: config.leader.leaseTtlMs,
        safetyMarginMs: config.leader.safetyMarginMs,
        logger,
        onElected: (leadership) => this.lead(leadership),
        onDemoted: () => {
          this.metrics.isLeader.set(0);
          this.metrics.exportClusterGauges(false);
        },
      }));
      election.start();
      // Stopping the election resigns (deletes the key) so another node takes over at once;
      // then the leader's loops, already aborted, are awaited.
      this.onStop('leader tasks', () => Promise.allSettled([...this.leaderTasks]).then(() => undefined));
      this.onStop('election', () => election.stop());
    }
    logger.info({ apiUrl: this._apiUrl }, 'node started');
  }

  /**
   * Keeps the target policy's list of the cluster's own servers current: this node's API once its
   * port is bound, every registered node's apiUrl, every etcd member's client and peer URLs, every
   * Kafka broker the metadata lists and every KRaft controller listener the quorum lists (a
   * cluster's servers beyond the configured ones), with names resolved again each pass. A source
   * that does not answer keeps its last answer.
   */
  private async watchClusterEndpoints(
    etcd: Etcd3,
    kafka: KafkaProbe,
    ownApi: { host: string; port: number; what: string },
  ): Promise<void> {
    const { config, logger } = this;
    const cluster = config.targets.policy.cluster;
    if (!cluster) return;
    const own = endpointOfUrl(this._apiUrl ?? '', 'node API');
    cluster.add(own ? [ownApi, own] : [ownApi]);
    const learn = async (source: string, read: () => Promise<Endpoint[]>) => {
      try {
        cluster.setDiscovered(source, await withTimeout(read(), 3000, `reading the cluster's ${source}`));
      } catch (err) {
        logger.debug({ err: toError(err), source }, 'cluster endpoints not read; keeping the known ones');
      }
    };
    const pass = async () => {
      await Promise.all([
        learn('nodes', async () =>
          (await listNodes(etcd, config.etcd.prefix)).flatMap((n) =>
            n.apiUrl ? (endpointOfUrl(n.apiUrl, 'node API') ?? []) : [],
          ),
        ),
        learn('etcd members', async () =>
          endpointsOfEtcdMembers((await etcd.cluster.memberList({})).members),
        ),
        learn('kafka brokers', async () =>
          (await kafka.brokers()).map((b) => ({ ...b, what: 'Kafka broker' })),
        ),
        learn('kafka controllers', async () =>
          (await kafka.controllers()).map((c) => ({ ...c, what: 'Kafka controller' })),
        ),
      ]);
      await cluster.refresh();
    };
    // The first pass completes before any job can execute here: names are resolved by then.
    await pass();
    this.repeatUntilStop('cluster endpoint watch', CLUSTER_ENDPOINTS_REFRESH_MS, pass);
  }

  /** Runs `pass` every `intervalMs` (after the one the caller made) until the node stops. */
  private repeatUntilStop(name: string, intervalMs: number, pass: () => Promise<void>): void {
    const abort = new AbortController();
    const loop = (async () => {
      while (!abort.signal.aborted) {
        await sleep(intervalMs, undefined, { signal: abort.signal }).catch(() => undefined);
        if (!abort.signal.aborted) await pass();
      }
    })();
    this.onStop(name, async () => {
      abort.abort();
      await loop;
    });
  }

  /**
   * Keeps a recent reading of which leader epochs have ended (EndedEpochs) for the worker's misfire
   * rule: read every second (every quarter of the misfire threshold when that is shorter), each
   * reading counting for half the threshold, at most 2.5 s. The first read is awaited (bounded),
   * so that the worker's first claims have it. Not kept below a 1 s threshold (the fence alone).
   */
  private async watchEndedEpochs(etcd: Etcd3): Promise<(() => EndedEpochsReading | null) | undefined> {
    const { config, logger } = this;
    const thresholdMs = config.worker.misfireThresholdMs;
    if (thresholdMs < 1000) return undefined;
    const maxAgeMs = Math.min(2500, thresholdMs / 2);
    const epochs = new EndedEpochs(etcd, `${config.etcd.prefix}/leader`, maxAgeMs);
    const read = () =>
      withTimeout(epochs.read(), maxAgeMs, 'reading the leader key').catch((err: unknown) =>
        logger.debug({ err: toError(err) }, 'leader key not read; ended epochs as last known'),
      );
    await read();
    this.repeatUntilStop('ended epochs watch', Math.min(1000, maxAgeMs / 2), read);
    return () => epochs.reading();
  }

  /** Ends the sessions an earlier leader left inside a transaction (see endPredecessorSessions). */
  private async endPredecessorSessions(leadership: Leadership): Promise<void> {
    const log = this.logger.child({ part: 'takeover' });
    try {
      await this.options.beforeTakeover?.();
      const ended = await endPredecessorSessions(this.leaderPool!, leadership.token, () =>
        leadership.isValid(),
      );
      if (ended === null)
        log.info({ token: leadership.token.toString() }, 'epoch ended before the takeover; no session ended');
      else if (ended.length > 0) log.warn({ sessions: ended }, "ended an earlier leader's open transactions");
    } catch (err) {
      // Without the right to end another session (pg_signal_backend) or without the database,
      // the predecessor's transaction ends on PostgreSQL's idle transaction timeout instead.
      log.warn({ err: toError(err) }, "could not end an earlier leader's open transactions");
    }
  }

  /** The registry's live workers but `but`, listed within 300 ms (hand-offs are waited for). */
  private async liveWorkersBut(but: string | null): Promise<string[]> {
    const nodes = await withTimeout(
      listNodes(this.etcd!, this.config.etcd.prefix),
      300,
      'listing the workers',
    );
    return workersBut(nodes, but);
  }

  /**
   * Announces runs the reaper re-queued to the live workers other than the one whose claim they
   * were taken from (see ReaperOptions.handOff), on the workers' hand-off channel. A hint only:
   * a run whose hint is lost still comes through Kafka or the polling fallback.
   */
  private handOffRequeued(messages: RunMessage[], claimedBy: string | null): void {
    const pool = this.leaderPool!;
    void (async () => {
      // No other worker, or no list of them (etcd unreachable): every worker may take them (the
      // claimant too, once it is back).
      const peers = await peersOrEveryone(
        () => this.liveWorkersBut(claimedBy),
        (err) =>
          this.logger.warn(
            { err: toError(err) },
            'cannot list the other workers; handing re-queued runs to all',
          ),
      );
      await handOffRuns(pool, messages, peers);
    })().catch((err: unknown) =>
      this.logger.warn(
        { err: toError(err), runs: messages.length },
        're-queued runs not handed to the other workers; they come through Kafka or polling',
      ),
    );
  }

  /** Starts the leader's loops for one epoch; they end when the epoch's signal aborts. */
  private lead(leadership: Leadership): void {
    const { config, logger, metrics } = this;
    metrics.isLeader.set(1);
    metrics.leaderElections.inc();
    const track = (name: string, task: Promise<void>) => {
      const tracked = task.catch((err: unknown) => logger.error({ err: toError(err) }, `${name} crashed`));
      this.leaderTasks.add(tracked);
      void tracked.finally(() => this.leaderTasks.delete(tracked));
    };
    // Bound to this epoch: a fenced write of this epoch proves a newer leader, but if that newer
    // leader is this node's next epoch, ending it would be wrong (see LeaderElection.stepDown).
    const stepDown = () => this.election?.stepDown('fenced', config.leader.leaseTtlMs, leadership);
    const leaderPool = this.leaderPool!;
    // A predecessor cut off inside a transaction still holds the fence and the rows it locked;
    // end its sessions so this epoch's first writes do not wait for PostgreSQL to notice.
    track('takeover', this.endPredecessorSessions(leadership));
    // A leader that cannot reach PostgreSQL, while etcd keeps its lease, hands the lead to a node
    // that can (see LeaderStallWatch); it campaigns again after as long again.
    const stallWatch = new LeaderStallWatch({
      signal: leadership.signal,
      stallMs: config.leader.stallMs,
      probe: () =>
        probeLeaderSessions({
          connectionString: config.database.url,
          applicationName: `helios-${config.node.id}-probe`,
          leaderApplicationName: leaderApplicationName(config.node.id),
          timeoutMs: STALL_PROBE_TIMEOUT_MS,
        }),
      stepDown: () => this.election?.stepDown('database-unreachable', config.leader.stallMs, leadership),
      logger: logger.child({ part: 'stall-watch' }),
    });
    const dispatcher = new Dispatcher({
      pool: leaderPool,
      leadership,
      notifications: this.notifications!,
      runsTopic: config.kafka.runsTopic,
      lookaheadMs: config.leader.lookaheadMs,
      batchSize: config.leader.batchSize,
      misfireThresholdMs: config.leader.misfireThresholdMs,
      logger: logger.child({ part: 'dispatcher' }),
      metrics,
      onFenced: stepDown,
      onDatabaseAnswered: () => stallWatch.progressed(),
      beforeWrite: this.options.beforeLeaderWrite,
    });
    track('dispatcher', dispatcher.run());
    const publisher = this.publisher!;
    const topics = this.topics!;
    const relay = new OutboxRelay({
      pool: leaderPool,
      // Publishing waits until the topics exist (the broker does not create them): a relay that
      // published into a missing topic would only fail, count failures and back off meanwhile.
      publisher: {
        publish: async (topic, messages) => {
          await topics.whenReady(leadership.signal);
          return publisher.publish(topic, messages);
        },
      },
      notifications: this.notifications!,
      signal: leadership.signal,
      beforePublish: this.options.beforePublish,
      logger: logger.child({ part: 'outbox-relay' }),
      metrics,
    });
    track('outbox relay', relay.run());
    const reaper = new Reaper({
      pool: leaderPool,
      leadership,
      topics: { runsTopic: config.kafka.runsTopic, deadLetterTopic: config.kafka.deadLetterTopic },
      intervalMs: config.leader.reaperIntervalMs,
      // The workers' claim grace: a run claimed ahead is called within it of its due time or not at all.
      unstartedAfterMs: config.worker.claimGraceMs,
      unstartedHold: this.unstartedHold,
      handOff: (messages, claimedBy) => this.handOffRequeued(messages, claimedBy),
      logger: logger.child({ part: 'reaper' }),
      runLines: this.runLines,
      metrics,
      onFenced: stepDown,
    });
    track('reaper', reaper.run());
    const pruner = new Pruner({
      pool: leaderPool,
      signal: leadership.signal,
      retention: config.leader.retention,
      logger: logger.child({ part: 'pruner' }),
      metrics,
    });
    track('pruner', pruner.run());
    metrics.exportClusterGauges(true);
    const kafka = this.kafka!;
    const signals = new ClusterSignals({
      db: leaderPool,
      signal: leadership.signal,
      intervalMs: config.leader.signalsIntervalMs,
      overdueMs: config.leader.misfireThresholdMs,
      kafkaLag: () => consumerGroupLag(kafka, config.kafka.consumerGroup, config.kafka.runsTopic),
      logger: logger.child({ part: 'cluster-signals' }),
      metrics,
    });
    track('cluster signals', signals.run());
  }

  /** Graceful stop within `config.node.shutdownTimeoutMs` per part. Safe to call twice. */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      this.state = 'stopping';
      const failures: Error[] = [];
      for (const cleanup of this.cleanups.reverse()) {
        try {
          await withTimeout(
            cleanup.run(),
            Math.max(this.config.node.shutdownTimeoutMs, 1000),
            `stopping ${cleanup.name}`,
          );
        } catch (err) {
          failures.push(toError(err));
          this.logger.warn({ err: toError(err), part: cleanup.name }, 'part did not stop cleanly');
        }
      }
      this.state = 'stopped';
      this.logger.info('node stopped');
      if (failures.length > 0) throw new AggregateError(failures, 'node stopped with errors');
    })();
    return this.stopping;
  }
}
