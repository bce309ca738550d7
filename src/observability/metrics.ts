import { performance } from 'node:perf_hooks';
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';
import { METRIC_LABEL_VALUES } from './metric-labels.js';
import type { LabelledMetric, LabelsOf, PoolName } from './metric-labels.js';

/** What a pool gauge reads: a pg pool's counts, or a share's (see store/pool-share.ts). */
export interface PoolGaugeSource {
  readonly inUse: number;
  readonly waiting: number;
  readonly size: number;
}

/**
 * Gauges of the cluster's state (queues, dead letters, Kafka lag) that the leader refreshes on an
 * interval (see ClusterSignals). They are registered only while this node leads, so each value is
 * exported by one node: a follower exporting 0, or its last reading from an old epoch, would be a
 * lie that `max` or `sum` over the nodes would mix in.
 */
function createClusterGauges() {
  const gauge = (name: string, help: string) => new Gauge({ name, help, registers: [] });
  return {
    outboxPending: gauge(
      'helios_outbox_pending_rows',
      'Outbox rows not yet published (counted up to 100000), read by the leader',
    ),
    outboxOldestAge: gauge(
      'helios_outbox_oldest_pending_age_seconds',
      'Age of the oldest outbox row due for publishing and not yet published (0 when none), read by the leader',
    ),
    runsQueued: gauge(
      'helios_runs_queued',
      'Runs queued cluster-wide (counted up to 100000), read by the leader',
    ),
    runsOverdue: gauge(
      'helios_runs_overdue',
      'Queued runs due longer ago than HELIOS_MISFIRE_THRESHOLD_MS, not counting helios_runs_waiting_forbid (counted up to 100000), read by the leader',
    ),
    runsWaitingForbid: gauge(
      'helios_runs_waiting_forbid',
      "Retries and replays of forbid jobs due and waiting for their job's running run to end (counted up to 100000), read by the leader",
    ),
    runsRunning: gauge(
      'helios_runs_running',
      'Runs executing cluster-wide (counted up to 100000), read by the leader',
    ),
    deadLettersOpen: gauge(
      'helios_dead_letters_open',
      'Dead letters not replayed (counted up to 100000), read by the leader',
    ),
    kafkaLag: gauge(
      'helios_kafka_consumer_lag_messages',
      "Messages of the runs topic the workers' consumer group has not committed, read by the leader",
    ),
    updated: gauge(
      'helios_cluster_signals_updated_timestamp_seconds',
      'When the leader last read the cluster gauges (Unix time); the Kafka lag may be older',
    ),
  };
}

/**
 * How often the pools' waiting counts are sampled for helios_db_pool_saturated_seconds_total. A
 * scrape reads the waiting gauge once every 15 s or so: a pool exhausted most of the time, whose
 * queue empties for a moment now and then, can read 0 at scrape after scrape, so the gauge alone
 * cannot tell how much of the time callers waited. Ten readings of memory a second cost nothing.
 */
export const POOL_SAMPLE_MS = 100;

/** What the worker's run queue holds, for the helios_worker_* gauges. */
export interface WorkerQueueReading {
  readonly held: number;
  readonly inFlight: number;
  readonly settling: number;
  readonly completionsHeld: number;
  readonly claimedAhead: number;
}

/** A counter whose labels, and their values, are those METRIC_LABEL_VALUES lists for it. */
type LabelledCounter<M extends LabelledMetric> = Omit<Counter, 'inc'> & {
  inc(labels: LabelsOf<M>, value?: number): void;
};

function labelledCounter<M extends LabelledMetric>(
  name: M,
  help: string,
  registry: Registry,
): LabelledCounter<M> {
  return new Counter({
    name,
    help,
    labelNames: Object.keys(METRIC_LABEL_VALUES[name]),
    registers: [registry],
  });
}

/** Every metric of one node, on its own registry (several nodes may share a process in tests). */
export function createMetrics(nodeId: string) {
  const registry = new Registry();
  registry.setDefaultLabels({ node: nodeId });
  collectDefaultMetrics({ register: registry });
  const cluster = createClusterGauges();
  const pools = new Map<PoolName, PoolGaugeSource>();
  const poolGauge = (name: string, help: string, read: (pool: PoolGaugeSource) => number) =>
    new Gauge({
      name,
      help,
      labelNames: ['pool'],
      registers: [registry],
      // Read at scrape time: the counts live in memory, reading them costs nothing.
      collect() {
        for (const [pool, source] of pools) this.set({ pool }, read(source));
      },
    });
  const poolSaturated = labelledCounter(
    'helios_db_pool_saturated_seconds_total',
    `Time during which callers waited for a connection of the pool (its waiting count sampled every ${POOL_SAMPLE_MS} ms): its rate is the fraction of the time the pool was exhausted`,
    registry,
  );
  let sampler: NodeJS.Timeout | undefined;
  let sampledAt = 0;
  const samplePools = () => {
    const now = performance.now();
    // A late tick (a busy event loop) stands for the whole time since the last one.
    const seconds = (now - sampledAt) / 1000;
    sampledAt = now;
    for (const [pool, source] of pools) if (source.waiting > 0) poolSaturated.inc({ pool }, seconds);
  };
  let workerQueue: (() => WorkerQueueReading) | undefined;
  const workerGauge = (name: string, help: string, read: (queue: WorkerQueueReading) => number) =>
    new Gauge({
      name,
      help,
      registers: [registry],
      // Read at scrape time, not set at each change of the queue (several times per run).
      collect() {
        if (workerQueue) this.set(read(workerQueue()));
      },
    });
  return {
    registry,
    cluster,
    /**
     * Exports the cluster gauges (`on`: this node leads) or withdraws them (the epoch ended).
     * Withdrawn gauges are reset, so a later epoch starts without the old readings.
     */
    exportClusterGauges(on: boolean): void {
      for (const gauge of Object.values(cluster)) {
        const name = (gauge as unknown as { name: string }).name;
        const registered = registry.getSingleMetric(name) !== undefined;
        if (on && !registered) registry.registerMetric(gauge);
        if (!on && registered) {
          registry.removeSingleMetric(name);
          gauge.reset();
        }
      }
    },
    /**
     * Counts `source` under `helios_db_pool_*{pool=name}` from now on, and samples its waiting
     * count every POOL_SAMPLE_MS until {@link stopPoolSampling}.
     */
    trackPool(name: PoolName, source: PoolGaugeSource): void {
      pools.set(name, source);
      poolSaturated.inc({ pool: name }, 0);
      if (sampler === undefined) {
        sampledAt = performance.now();
        sampler = setInterval(samplePools, POOL_SAMPLE_MS);
        sampler.unref();
      }
    },
    /** Ends the sampling of the pools' waiting counts (the node stops). */
    stopPoolSampling(): void {
      clearInterval(sampler);
      sampler = undefined;
    },
    poolSaturated,
    poolInUse: poolGauge(
      'helios_db_pool_in_use',
      'PostgreSQL connections checked out: pool main (API, worker), leader (leader loops) or worker (the share of main the worker may use)',
      (p) => p.inUse,
    ),
    poolWaiting: poolGauge(
      'helios_db_pool_waiting',
      'Callers waiting for a PostgreSQL connection of the pool (see helios_db_pool_in_use)',
      (p) => p.waiting,
    ),
    poolSize: poolGauge(
      'helios_db_pool_size',
      'Most connections the pool (or share) may use at once',
      (p) => p.size,
    ),
    misfires: labelledCounter(
      'helios_misfires_total',
      "Misfires: jobs the dispatcher found with occurrences later than HELIOS_MISFIRE_THRESHOLD_MS (once per job and catch-up), by the job's misfire policy",
      registry,
    ),
    isLeader: new Gauge({ name: 'helios_is_leader', help: '1 while this node leads', registers: [registry] }),
    leaderElections: new Counter({
      name: 'helios_leader_elections_total',
      help: 'Epochs this node has led',
      registers: [registry],
    }),
    fenceRejections: new Counter({
      name: 'helios_fence_rejections_total',
      help: 'Leader writes rejected because a newer fencing token had written',
      registers: [registry],
    }),
    leaderPassFailures: labelledCounter(
      'helios_leader_pass_failures_total',
      'Passes of a leader loop (dispatch, reaper) that failed and are tried again after a back-off',
      registry,
    ),
    runsCreated: labelledCounter(
      'helios_runs_created_total',
      'Runs created by the dispatcher, by resulting state',
      registry,
    ),
    dispatchDuration: new Histogram({
      name: 'helios_dispatch_batch_seconds',
      help: 'Time of one dispatch transaction',
      buckets: [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5],
      registers: [registry],
    }),
    outboxPublished: new Counter({
      name: 'helios_outbox_published_total',
      help: 'Outbox rows published to Kafka',
      registers: [registry],
    }),
    outboxRowsRefused: new Counter({
      name: 'helios_outbox_rows_refused_total',
      help: 'Tries of outbox rows the broker refused on their own (too large, not authorised): put off and tried again, never published until the cause is fixed',
      registers: [registry],
    }),
    outboxPublishFailures: new Counter({
      name: 'helios_outbox_publish_failures_total',
      help: 'Failed publish attempts of outbox batches',
      registers: [registry],
    }),
    runsExecuted: labelledCounter(
      'helios_runs_executed_total',
      'Attempts executed by this worker, by outcome',
      registry,
    ),
    staleCompletions: new Counter({
      name: 'helios_stale_completions_total',
      help: 'Completions discarded because the claim had been lost',
      registers: [registry],
    }),
    lateness: new Histogram({
      name: 'helios_run_start_lateness_seconds',
      help: 'Time between a run being due and its HTTP call starting',
      buckets: [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
      registers: [registry],
    }),
    runsReaped: labelledCounter(
      'helios_runs_reaped_total',
      'Runs whose claim expired: to queued-uncharged (no attempt used up), queued (charged as a failed attempt) or dead',
      registry,
    ),
    reaperPassesCut: labelledCounter(
      'helios_reaper_passes_cut_total',
      'Reaper passes cut short: reason statement_timeout (a statement cancelled, the pass rolled back) or budget (committed with expired runs left to the next pass)',
      registry,
    ),
    runClaims: labelledCounter(
      'helios_run_claims_total',
      'Claim attempts by this worker: source kafka|poll, result claimed|missed|skipped|early|waiting',
      registry,
    ),
    pruned: labelledCounter(
      'helios_pruned_rows_total',
      'Rows deleted by retention: table runs (with their attempts and dead letters) or outbox',
      registry,
    ),
    prunePasses: labelledCounter(
      'helios_prune_passes_total',
      "Passes of the leader's pruner by table (outbox, runs) and result: succeeded, incomplete (a sweep of runs that left some jobs' runs unpruned) or failed (tried again after a back-off)",
      registry,
    ),
    jobsParked: new Counter({
      name: 'helios_jobs_parked_total',
      help: 'Jobs the dispatcher parked (no next run) because their schedule could not be evaluated',
      registers: [registry],
    }),
    startsEarly: new Counter({
      name: 'helios_starts_early_total',
      help: "Calls held back because PostgreSQL found their run not yet due: this worker's estimate of the database clock ran early by more than HELIOS_CLOCK_SKEW_TOLERANCE_MS",
      registers: [registry],
    }),
    settleRetries: new Counter({
      name: 'helios_settle_retries_total',
      help: 'Writes of an attempt outcome (completion, retry, dead letter) retried after a failure while the claim held',
      registers: [registry],
    }),
    runsSkipped: labelledCounter(
      'helios_runs_skipped_total',
      'Runs skipped at claim time by their concurrency policy',
      registry,
    ),
    runsHandedOff: new Counter({
      name: 'helios_runs_handed_off_total',
      help: 'Run announcements a stopping worker handed to the other workers instead of calling them',
      registers: [registry],
    }),
    runsReplaced: new Counter({
      name: 'helios_runs_replaced_total',
      help: 'Running runs failed with reason replaced: a run of their replace job asked for later started',
      registers: [registry],
    }),
    deadLetters: new Counter({
      name: 'helios_dead_letters_total',
      help: 'Runs that exhausted their attempts and were dead-lettered',
      registers: [registry],
    }),
    httpDuration: new Histogram({
      name: 'helios_run_http_seconds',
      help: 'Duration of the HTTP call of one attempt (including reading the response excerpt)',
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
      registers: [registry],
    }),
    /** Reads `read` for the helios_worker_* gauges at each scrape (the worker's one queue). */
    trackWorkerQueue(read: () => WorkerQueueReading): void {
      workerQueue = read;
    },
    runsHeld: workerGauge(
      'helios_worker_held_runs',
      'Run announcements held in memory, not yet claimed: until they are within the claim lead, or until the claim budget has room',
      (q) => q.held,
    ),
    runsInFlight: workerGauge(
      'helios_worker_in_flight_runs',
      'HTTP calls in flight on this worker: its execution slots in use (not runs whose call ended and whose outcome is being written)',
      (q) => q.inFlight,
    ),
    runsSettling: workerGauge(
      'helios_worker_settling_runs',
      'Runs whose HTTP call ended and whose outcome this worker has not written yet (held writes included)',
      (q) => q.settling,
    ),
    completionsHeld: workerGauge(
      'helios_worker_held_completions',
      'Successes whose write this worker holds back while it has a backlog of calls (HELIOS_COMPLETION_HOLD_MS)',
      (q) => q.completionsHeld,
    ),
    runsClaimedAhead: workerGauge(
      'helios_worker_claimed_waiting_runs',
      'Runs this worker is claiming or has claimed and not yet called: waiting for their time or for an execution slot',
      (q) => q.claimedAhead,
    ),
  };
}

export type Metrics = ReturnType<typeof createMetrics>;
