import type pg from 'pg';
import type { Logger } from '../observability/logger.js';
import type { Metrics } from '../observability/metrics.js';
import { ClaimLostError, toError } from '../errors.js';
import { inTransaction } from '../store/db.js';
import { failAttempt, releaseClaim, type AttemptReport, type Topics } from '../store/attempts.js';
import { replaceOlderRuns, type ClaimedRun } from '../store/runs.js';
import { retryDelayMs } from './backoff.js';
import type { DbClock } from './db-clock.js';
import type { HttpExecutor } from './http-executor.js';

/** The abort reason of calls cut short because the worker is stopping (the claim is released). */
export class WorkerStoppingError extends Error {
  override name = 'WorkerStoppingError';
}

/** What running one attempt needs; one per worker. */
export interface AttemptContext {
  readonly pool: pg.Pool;
  readonly nodeId: string;
  readonly executor: HttpExecutor;
  readonly topics: Topics;
  readonly clock: DbClock;
  /** Records a success if this node still holds the claim (batched); false when stale. */
  readonly complete: (run: ClaimedRun, report: AttemptReport) => Promise<boolean>;
  readonly logger: Logger;
  readonly metrics: Metrics;
}

/**
 * Executes a claimed attempt and settles it: succeeded, retry or dead, each conditional on this
 * node still holding the claim. `cancel` aborts the HTTP call: with a ClaimLostError (replaced or
 * taken over: nothing is written) or a WorkerStoppingError (the claim is handed back).
 * Never rejects; a settle that fails (PostgreSQL away) leaves the claim to expire and the reaper
 * to recover it.
 */
export async function runAttempt(ctx: AttemptContext, run: ClaimedRun, cancel: AbortSignal): Promise<void> {
  const { pool, nodeId, logger, metrics } = ctx;
  // Bound lazily: most attempts log nothing, and a child logger per run is measurable at 200/s.
  let child: Logger | undefined;
  const log = () => (child ??= logger.child({ run: run.id, job: run.jobId, attempt: run.attempt }));
  try {
    if (run.concurrency === 'replace') {
      const replaced = await replaceOlderRuns(pool, run.jobId);
      if (replaced.length > 0) metrics.runsReplaced.inc(replaced.length);
      // A newer occurrence is already running: this one was replaced before it started.
      if (replaced.includes(run.id)) {
        metrics.runsExecuted.inc({ outcome: 'replaced' });
        return;
      }
    }
    if (run.attempt === 1)
      metrics.lateness.observe(Math.max(0, ctx.clock.now() - run.scheduledFor.getTime()) / 1000);
    const report = await ctx.executor.execute(run, cancel);
    if (report.durationMs !== null) metrics.httpDuration.observe(report.durationMs / 1000);

    // Judged by the call's outcome, not by the signal: a call that completed just before an abort
    // is settled like any other (its completion is still conditional on the claim).
    if (report.outcome === 'cancelled') {
      const reason: unknown = cancel.reason;
      if (reason instanceof WorkerStoppingError) {
        const released = await inTransaction(pool, (client) =>
          releaseClaim(client, run, nodeId, report, ctx.topics.runsTopic),
        );
        metrics.runsExecuted.inc({ outcome: 'cancelled' });
        log().info({ released }, 'call aborted by shutdown; claim handed back');
        return;
      }
      // The claim is gone (replaced, or expired and taken over): whoever took it records the run.
      metrics.runsExecuted.inc({ outcome: reason instanceof ClaimLostError ? 'claim-lost' : 'cancelled' });
      metrics.staleCompletions.inc();
      log().info({ reason: toError(reason).message }, 'call aborted: claim lost');
      return;
    }

    metrics.runsExecuted.inc({ outcome: report.outcome });
    if (report.outcome === 'succeeded') {
      if (!(await ctx.complete(run, report))) stale(ctx, log(), report.outcome);
      return;
    }
    const delay = retryDelayMs(run.attempt, run);
    const result = await inTransaction(pool, (client) =>
      failAttempt(client, run, { nodeId }, report, delay, ctx.topics),
    );
    if (!result) return stale(ctx, log(), report.outcome);
    if (result.state === 'dead') {
      metrics.deadLetters.inc();
      log().warn(
        { error: report.error, status: report.statusCode },
        report.retryable === false
          ? 'run is dead: its target was refused'
          : 'run is dead: attempts exhausted',
      );
    } else {
      log().info(
        { error: report.error, status: report.statusCode, retryInMs: delay },
        'attempt failed; retrying',
      );
    }
  } catch (err) {
    log().error(
      { err: toError(err) },
      'settling the attempt failed; the reaper recovers it when the claim expires',
    );
  }
}

function stale(ctx: AttemptContext, log: Logger, outcome: string): void {
  ctx.metrics.staleCompletions.inc();
  log.warn({ outcome }, 'completion discarded: the claim had been lost');
}
