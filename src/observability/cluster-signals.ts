import { setTimeout as sleep } from 'node:timers/promises';
import { toError } from '../errors.js';
import type { Queryable } from '../store/db.js';
import { readClusterCounts } from '../store/signals.js';
import type { Logger } from './logger.js';
import type { Metrics } from './metrics.js';

/** Counts stop at this many rows (see store/signals.ts): beyond it, only "far too many" matters. */
export const CLUSTER_COUNT_CAP = 100_000;

/** Options of {@link ClusterSignals}. */
export interface ClusterSignalsOptions {
  /** The leader's pool: the reads never wait behind the worker's runs. */
  readonly db: Queryable;
  /** Ends the loop (the leader's epoch signal). */
  readonly signal: AbortSignal;
  /** Pause between readings (HELIOS_SIGNALS_INTERVAL_MS, default 5000). */
  readonly intervalMs: number;
  /** Queued runs due longer ago than this are overdue (HELIOS_MISFIRE_THRESHOLD_MS). */
  readonly overdueMs: number;
  /** The workers' consumer lag on the runs topic (broker/consumerGroupLag). */
  readonly kafkaLag: () => Promise<number>;
  readonly logger: Logger;
  readonly metrics: Metrics;
}

/**
 * The leader's loop that refreshes the cluster gauges (metrics.cluster) every `intervalMs`.
 * Computed by the leader on an interval rather than at scrape time: one bounded statement per
 * interval for the whole cluster, however many nodes and scrapers there are, and a scrape never
 * waits on PostgreSQL or Kafka (a slow database would otherwise time out the very scrape that
 * should show it). A failed reading keeps the previous values; the updated-timestamp gauge shows
 * their age. Runs until the signal aborts; never rejects.
 */
export class ClusterSignals {
  constructor(private readonly options: ClusterSignalsOptions) {}

  async run(): Promise<void> {
    const { signal, intervalMs, logger } = this.options;
    let failures = 0;
    while (!signal.aborted) {
      try {
        await this.refresh();
        failures = 0;
      } catch (err) {
        if (signal.aborted) return;
        failures += 1;
        // Once per outage, not every interval: the dispatcher logs the database's absence too.
        if (failures === 1) logger.warn({ err: toError(err) }, 'reading the cluster gauges failed');
      }
      await sleep(intervalMs, undefined, { signal }).catch(() => undefined);
    }
  }

  /**
   * One reading of the database counts and the Kafka lag, each on its own: one may fail alone,
   * and a slow one (the lag read waits up to its timeout while Kafka is down) must not hold the
   * other's gauges back.
   */
  async refresh(): Promise<void> {
    const { db, signal, overdueMs, metrics, logger } = this.options;
    const gauges = metrics.cluster;
    const lag = this.options.kafkaLag().then(
      (value) => {
        // A reading that ends after the epoch must not show up in the next one.
        if (!signal.aborted) gauges.kafkaLag.set(value);
      },
      (err: unknown) => logger.debug({ err: toError(err) }, 'reading the Kafka consumer lag failed'),
    );
    try {
      const c = await readClusterCounts(db, overdueMs, CLUSTER_COUNT_CAP);
      if (signal.aborted) return;
      gauges.outboxPending.set(c.outboxPending);
      gauges.outboxOldestAge.set(c.outboxOldestAgeSeconds);
      gauges.runsQueued.set(c.runsQueued);
      gauges.runsOverdue.set(c.runsOverdue);
      gauges.runsWaitingForbid.set(c.runsWaitingForbid);
      gauges.runsRunning.set(c.runsRunning);
      gauges.deadLettersOpen.set(c.deadLettersOpen);
      gauges.updated.set(Date.now() / 1000);
    } finally {
      // The next interval starts once both readings ended: never two lag reads at once.
      await lag;
    }
  }
}
