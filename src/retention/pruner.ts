import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { toError } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { Metrics } from '../observability/metrics.js';
import type { Database } from '../store/db.js';
import type { RetentionConfig } from '../config/index.js';
import { databaseCutoff, pruneOutbox, pruneRuns } from '../store/retention.js';
import { loopBackoffMs } from '../loop-backoff.js';

/** Options of {@link Pruner}. */
export interface PrunerOptions {
  readonly pool: Database;
  /** Ends the loop (the leader's epoch signal: one node prunes). */
  readonly signal: AbortSignal;
  /** What is kept, and for how long (config.leader.retention). */
  readonly retention: RetentionConfig;
  /** Pause between outbox passes; default 5000 ms. Runs are swept every `runSweepMs` (60000). */
  readonly intervalMs?: number;
  readonly runSweepMs?: number;
  readonly logger: Logger;
  readonly metrics: Metrics;
}

/** Outbox rows per DELETE; the loop goes on without sleeping while batches come back full. */
const OUTBOX_BATCH = 10_000;
/** Jobs per run-pruning statement, and runs per job in it. */
const JOBS_PER_BATCH = 200;
const RUNS_PER_JOB = 500;

/**
 * The leader's loop that keeps history bounded: published outbox rows go as fast as they are
 * produced (a full batch is followed by the next at once, so no sustained rate outgrows it), and
 * finished runs past the retention, beyond each job's newest `keepPerJob`, are swept a few jobs
 * at a time. Every statement is small and locks only the rows it deletes (SKIP LOCKED), so it
 * never competes with dispatch or claims for long. Runs until the signal aborts; never rejects.
 */
export class Pruner {
  constructor(private readonly options: PrunerOptions) {}

  async run(): Promise<void> {
    const { signal, logger } = this.options;
    const intervalMs = this.options.intervalMs ?? 5000;
    const runSweepMs = this.options.runSweepMs ?? 60_000;
    let lastSweep = -Infinity;
    let failures = 0;
    while (!signal.aborted) {
      try {
        await this.pruneOutbox();
        if (performance.now() - lastSweep >= runSweepMs) {
          lastSweep = performance.now();
          await this.sweepRuns();
        }
        failures = 0;
      } catch (err) {
        if (signal.aborted) return;
        failures += 1;
        logger.warn({ err: toError(err), failures }, 'pruning failed; retrying');
      }
      const pauseMs = failures === 0 ? intervalMs : Math.max(intervalMs, loopBackoffMs(failures, 60_000));
      await sleep(pauseMs, undefined, { signal }).catch(() => undefined);
    }
  }

  /** Deletes published outbox rows past the retention, batch after batch until none is left. */
  async pruneOutbox(): Promise<number> {
    const { pool, signal, metrics, retention } = this.options;
    let total = 0;
    while (!signal.aborted) {
      const deleted = await pruneOutbox(pool, retention.outboxMs, OUTBOX_BATCH);
      total += deleted;
      if (deleted > 0) metrics.pruned.inc({ table: 'outbox' }, deleted);
      if (deleted < OUTBOX_BATCH) break;
    }
    return total;
  }

  /** One pass over every job, pruning its finished runs past the retention. */
  async sweepRuns(): Promise<number> {
    const { pool, signal, metrics, retention } = this.options;
    const cutoff = await databaseCutoff(pool, retention.runsMs);
    let afterJob: string | null = null;
    let total = 0;
    while (!signal.aborted) {
      const { lastJob, pruned } = await pruneRuns(pool, {
        cutoff,
        keepPerJob: retention.keepPerJob,
        afterJob,
        jobs: JOBS_PER_BATCH,
        perJob: RUNS_PER_JOB,
      });
      total += pruned;
      if (pruned > 0) metrics.pruned.inc({ table: 'runs' }, pruned);
      // A job with more than RUNS_PER_JOB to prune is finished by the next sweeps.
      if (lastJob === null) break;
      afterJob = lastJob;
    }
    if (total > 0) this.options.logger.info({ runs: total, cutoff }, 'pruned finished runs');
    return total;
  }
}
