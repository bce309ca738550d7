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

  /** One reading of the database counts and the Kafka lag (each on its own: one may fail alone). */
  async refresh(): Promise<void> {
    const { db, signal, overdueMs, metrics, logger } = this.options;
    const gauges = metrics.cluster;
    const [counts, lag] = await Promise.allSettled([
      readClusterCounts(db, overdueMs, CLUSTER_COUNT_CAP),
      this.options.kafkaLag(),
    ]);
    // A reading that ends after the epoch must not show up in the next one.
    if (signal.aborted) return;
    if (lag.status === 'fulfilled') gauges.kafkaLag.set(lag.value);
    else logger.debug({ err: toError(lag.reason) }, 'reading the Kafka consumer lag failed');
    if (counts.status === 'rejected') throw counts.reason;
    const c = counts.value;
    gauges.outboxPending.set(c.outboxPending);
    gauges.outboxOldestAge.set(c.outboxOldestAgeSeconds);
    gauges.runsQueued.set(c.runsQueued);
    gauges.runsOverdue.set(c.runsOverdue);
    gauges.runsRunning.set(c.runsRunning);
    gauges.deadLettersOpen.set(c.deadLettersOpen);
    gauges.updated.set(Date.now() / 1000);
  }
}
