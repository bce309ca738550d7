import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { toError } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { Metrics } from '../observability/metrics.js';
import type { Database, DbClient, Queryable } from '../store/db.js';
import type { RetentionConfig } from '../config/index.js';
import { isDatabaseUnavailable, isServerError, withClient } from '../store/db.js';
import { databaseCutoff, nextJobAfter, pruneOutbox, pruneRuns } from '../store/retention.js';
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
 * at a time (a job with more than a batch to prune is pruned again before the sweep moves on, so
 * however fast a job makes runs, each sweep leaves it its newest). Every statement is small and
 * locks only the rows it deletes (SKIP LOCKED), so it never competes with dispatch or claims for
 * long. Runs until the signal aborts; never rejects.
 */
export class Pruner {
  /** When the last outbox pass began (performance.now()): a long sweep of runs keeps it going. */
  private outboxPassAt = -Infinity;

  constructor(private readonly options: PrunerOptions) {
    // Every series from 0, so that the first pass of an epoch shows in increase().
    for (const [table, result] of [
      ['outbox', 'succeeded'],
      ['outbox', 'failed'],
      ['runs', 'succeeded'],
      ['runs', 'incomplete'],
      ['runs', 'failed'],
    ] as const)
      options.metrics.prunePasses.inc({ table, result }, 0);
  }

  async run(): Promise<void> {
    const { signal, logger } = this.options;
    const intervalMs = this.options.intervalMs ?? 5000;
    const runSweepMs = this.options.runSweepMs ?? 60_000;
    let lastSweep = -Infinity;
    let failures = 0;
    // Each part on its own: an outbox prune that fails does not stop the sweeps of runs.
    const attempt = async (what: string, part: () => Promise<unknown>): Promise<boolean> => {
      try {
        await part();
        return true;
      } catch (err) {
        if (!signal.aborted)
          logger.warn({ err: toError(err), failures: failures + 1 }, `${what} failed; retrying`);
        return false;
      }
    };
    while (!signal.aborted) {
      let ok = await attempt('pruning the outbox', () => this.pruneOutbox());
      if (!signal.aborted && performance.now() - lastSweep >= runSweepMs) {
        lastSweep = performance.now();
        ok = (await attempt('pruning finished runs', () => this.sweepRuns())) && ok;
      }
      if (signal.aborted) return;
      failures = ok ? 0 : failures + 1;
      const pauseMs = failures === 0 ? intervalMs : Math.max(intervalMs, loopBackoffMs(failures, 60_000));
      await sleep(pauseMs, undefined, { signal }).catch(() => undefined);
    }
  }

  /**
   * Deletes published outbox rows past the retention, batch after batch until none is left.
   * Counted in helios_prune_passes_total{table="outbox"}.
   */
  async pruneOutbox(): Promise<number> {
    return this.pruneOutboxOn(this.options.pool);
  }

  /** An outbox pass on `db`: the pool, or a sweep's own session (see sweepJobsOn). */
  private async pruneOutboxOn(db: Queryable): Promise<number> {
    this.outboxPassAt = performance.now();
    return this.counted('outbox', async () => ({ pruned: await this.deleteOutbox(db), skipped: 0 }));
  }

  /**
   * One pass over every job, pruning its finished runs past the retention (see sweepJobs).
   * Counted in helios_prune_passes_total{table="runs"}: incomplete when a job was skipped.
   */
  async sweepRuns(): Promise<number> {
    return this.counted('runs', () => this.sweepJobs());
  }

  /** Runs one pass and counts its result; an aborted pass is not counted. */
  private async counted(
    table: 'outbox' | 'runs',
    pass: () => Promise<{ pruned: number; skipped: number }>,
  ): Promise<number> {
    const { signal, metrics } = this.options;
    let result: 'succeeded' | 'incomplete' | 'failed' = 'failed';
    try {
      const { pruned, skipped } = await pass();
      result = skipped > 0 ? 'incomplete' : 'succeeded';
      return pruned;
    } finally {
      if (!signal.aborted) metrics.prunePasses.inc({ table, result });
    }
  }

  private async deleteOutbox(db: Queryable): Promise<number> {
    const { signal, metrics, retention } = this.options;
    let total = 0;
    while (!signal.aborted) {
      const deleted = await pruneOutbox(db, retention.outboxMs, OUTBOX_BATCH);
      total += deleted;
      if (deleted > 0) metrics.pruned.inc({ table: 'outbox' }, deleted);
      if (deleted < OUTBOX_BATCH) break;
    }
    return total;
  }

  /**
   * One pass over every job, pruning its finished runs past the retention. A batch that PostgreSQL
   * refuses (a statement timeout, a trigger, a lock it cannot get) is tried again on fewer jobs,
   * halving down to one; a job whose runs still cannot be pruned is left for the next sweep and
   * the pass goes on past it, so no job keeps the others' history from being pruned. An outage
   * ends the pass (it rejects).
   *
   * The pass runs on one connection. PostgreSQL answers a refused statement before its transaction
   * has ended, and the pool discards a connection whose query failed: a smaller batch sent at once
   * on another connection could find the runs the refused one had locked still locked and skip
   * them (SKIP LOCKED): nothing of any job in it pruned, the refusing job's runs not even tried,
   * and the pass going on past them as a success. A session reads its next statement only once the
   * failed one's transaction has ended.
   */
  private async sweepJobs(): Promise<{ pruned: number; skipped: number }> {
    // A refused statement is handled inside; what ends the pass may have ended the session too, so
    // the client is not given back after a throw.
    return withClient(this.options.pool, (session) => this.sweepJobsOn(session));
  }

  private async sweepJobsOn(session: DbClient): Promise<{ pruned: number; skipped: number }> {
    const { signal, metrics, retention, logger } = this.options;
    const cutoff = await databaseCutoff(session, retention.runsMs);
    let afterJob: string | null = null;
    let jobs = JOBS_PER_BATCH;
    let total = 0;
    let skipped = 0;
    while (!signal.aborted) {
      let batch: { lastJob: string | null; full: boolean; pruned: number };
      try {
        batch = await pruneRuns(session, {
          cutoff,
          keepPerJob: retention.keepPerJob,
          afterJob,
          jobs,
          perJob: RUNS_PER_JOB,
        });
      } catch (err) {
        if (signal.aborted || isOutage(err)) throw err;
        if (jobs > 1) {
          jobs = Math.ceil(jobs / 2);
          continue;
        }
        const job = await nextJobAfter(session, afterJob);
        logger.warn(
          { err: toError(err), job },
          "a job's finished runs could not be pruned; left for the next sweep",
        );
        skipped += 1;
        if (job === null) break;
        afterJob = job;
        continue;
      }
      total += batch.pruned;
      if (batch.pruned > 0) metrics.pruned.inc({ table: 'runs' }, batch.pruned);
      // A job with more than RUNS_PER_JOB to prune is tried again before the pass moves past it:
      // left to the next sweeps (a minute apart), a job given more runs than that a minute (manual
      // triggers, ten a second) grew for ever.
      if (batch.lastJob === null && !batch.full) break;
      afterJob = batch.lastJob;
      // Grown again only past a full job: grown after each of its batches, the next took in again
      // a job whose batch was refused (now and then halved down to one), refused again each time.
      if (!batch.full) jobs = Math.min(JOBS_PER_BATCH, jobs * 2);
      // A sweep that takes long (the first ones after the retention was shortened: every job full)
      // would hold back the outbox passes the loop makes between sweeps, and the outbox grows by
      // every run dispatched meanwhile. A failed pass is counted; the loop's next one logs it. On
      // the sweep's session, idle between its statements: from the pool it waited for a second
      // connection, and on a leader pool of one (the sweep holding it) every batch waited out the
      // pool's connect timeout (5 s) and the pass failed. An outage ends the sweep as its own
      // statements' would: the session may be gone, or still waiting for the unanswered statement.
      if (performance.now() - this.outboxPassAt >= (this.options.intervalMs ?? 5000))
        await this.pruneOutboxOn(session).catch((err: unknown) => {
          if (signal.aborted || isOutage(err)) throw err;
        });
    }
    if (total > 0 || skipped > 0)
      logger.info({ runs: total, cutoff, jobsSkipped: skipped }, 'pruned finished runs');
    return { pruned: total, skipped };
  }
}

/**
 * The database could not be used at all (isDatabaseUnavailable), which no smaller batch mends; a
 * statement cancelled by its timeout (57014) is this batch's, not an outage.
 */
function isOutage(err: unknown): boolean {
  return isDatabaseUnavailable(err) && !(isServerError(err) && err.code === '57014');
}
