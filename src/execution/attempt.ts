import { setTimeout as sleep } from 'node:timers/promises';
import type { Connections } from '../store/pool-share.js';
import type { Logger } from '../observability/logger.js';
import { NO_RUN_LINE_LIMIT, type RunLines, type RunLog } from '../observability/run-lines.js';
import type { Metrics } from '../observability/metrics.js';
import { ClaimLostError, toError } from '../errors.js';
import { inTransaction } from '../store/db.js';
import {
  attemptOutcome,
  completeSucceededMany,
  failAttempt,
  releaseClaim,
  type AttemptReport,
  type FailureResult,
  type Topics,
} from '../store/attempts.js';
import { replaceOlderRuns, type ClaimedRun, type StartAnswer } from '../store/runs.js';
import { retryDelayMs } from './backoff.js';
import { settleReadTimeoutMs } from './batching.js';
import type { DbClock } from './db-clock.js';
import type { HttpExecutor } from './http-executor.js';
import { FORGIVEN_EXPIRIES } from './reaper.js';
import type { RunMessage } from '../model.js';

/** The abort reason of calls cut short because the worker is stopping (the claim is released). */
export class WorkerStoppingError extends Error {
  override name = 'WorkerStoppingError';
}

/** What running one attempt needs; one per worker. */
export interface AttemptContext {
  readonly pool: Connections;
  readonly nodeId: string;
  readonly executor: HttpExecutor;
  readonly topics: Topics;
  readonly clock: DbClock;
  /**
   * Announces a run handed back by this stopping worker to the other workers at once (its Kafka
   * re-announcement waits on this worker's partitions while it restarts). Optional.
   */
  readonly handOff?: (messages: RunMessage[]) => void;
  /**
   * Marks a run claimed ahead of its time started (batched): true when it may be called, false
   * when a pause or an edit withdrew it meanwhile, or its claim was lost; not started when it is
   * not yet due by the database clock (StartAnswer).
   */
  readonly start: (run: ClaimedRun) => Promise<StartAnswer>;
  /** Records a success if this node still holds the claim (batched); false when stale. */
  readonly complete: (run: ClaimedRun, report: AttemptReport) => Promise<boolean>;
  /**
   * Settles a failed attempt if this node still holds the claim (the worker's is batched): its
   * retry or dead letter; null when stale. Default: one transaction (failAttempt).
   */
  readonly fail?: (
    run: ClaimedRun,
    report: AttemptReport,
    retryDelayMs: number,
  ) => Promise<FailureResult | null>;
  /**
   * Gives the claim back without using up an attempt (the worker's is batched): the next attempt's
   * announcement, or null when the claim had been lost. With `expiryBound`, counted as one of the
   * run's forgiven expiries: null, nothing written, once it has that many (releaseClaim). Default:
   * one transaction (releaseClaim).
   */
  readonly release?: (
    run: ClaimedRun,
    report: AttemptReport,
    expiryBound?: number,
  ) => Promise<RunMessage | null>;
  /** Whether `complete` may hold this success's write back while calls are underway. Default: no. */
  readonly writeMayWait?: (run: ClaimedRun, report: AttemptReport) => boolean;
  readonly logger: Logger;
  /** The node's budget of lines about single runs. Default: no limit. */
  readonly runLines?: RunLines;
  readonly metrics: Metrics;
}

/**
 * Executes a claimed attempt and settles it: succeeded, retry or dead, each conditional on this
 * node still holding the claim. `cancel` aborts the HTTP call: with a ClaimLostError (replaced or
 * taken over: nothing is written) or a WorkerStoppingError (the claim is handed back).
 * Never rejects. A settle write that fails (PostgreSQL away, a pool timeout, a failed batch) is
 * retried while the claim holds ({@link whileClaimed}): a call that finished must not be made
 * again because its outcome could not be written the first time. Only when the claim has expired
 * does the reaper recover the run.
 */
export async function runAttempt(
  ctx: AttemptContext,
  run: ClaimedRun,
  cancel: AbortSignal,
  drainLeftMs?: () => number,
  callEnded?: (called?: boolean, writeMayWait?: boolean) => void,
  untilSlot: () => Promise<void> = async () => undefined,
): Promise<void> {
  const { pool, nodeId, logger, metrics } = ctx;
  // Made lazily: most attempts log nothing.
  let runLog: RunLog | undefined;
  const log = () =>
    (runLog ??= (ctx.runLines ?? NO_RUN_LINE_LIMIT).forRun(logger, () => ({
      run: run.id,
      job: run.jobId,
      attempt: run.attempt,
    })));
  // The unbatched settle writes' statements and COMMIT wait for their answers as the batchers'
  // do: while a retry could still follow within the claim (settleReadTimeoutMs).
  const bounded = () => ({ readTimeoutMs: settleReadTimeoutMs([{ run }], ctx.clock), boundCommit: true });
  // Hands the claim back without using up an attempt, retried while it holds (whileClaimed).
  const release = (report: AttemptReport, expiryBound?: number) =>
    whileClaimed(ctx, run, log, () =>
      ctx.release
        ? ctx.release(run, report, expiryBound)
        : inTransaction(
            pool,
            (client) => releaseClaim(client, run, nodeId, report, ctx.topics.runsTopic, expiryBound),
            bounded(),
          ),
    );
  // Settles a failed attempt (its retry or dead letter), retried while the claim holds.
  const fail = (report: AttemptReport, delay: number) =>
    whileClaimed(ctx, run, log, () =>
      ctx.fail
        ? ctx.fail(run, report, delay)
        : inTransaction(
            pool,
            (client) => failAttempt(client, run, { nodeId }, report, delay, ctx.topics),
            bounded(),
          ),
    );
  try {
    // First, before anything acts for this run: a withdrawn run must not replace another (below).
    // Not for a run aborted while it waited for its time (a drain, a lost claim): no call follows,
    // and marking it started before it is due would keep it from a pause after it is handed back.
    // Aborted while it waited for the database clock, it goes on to be handed back or dropped below.
    let notMade: NotMade | undefined;
    if (run.startPending && !cancel.aborted) {
      const started = await startWhenDue(ctx, run, cancel, log);
      if (started === 'not-started') {
        callEnded?.(false);
        return;
      }
      if (typeof started === 'object') notMade = started;
    }
    // A run claimed ahead is marked started while it waits for its slot (run-queue.ts, start
    // passes); one that will make no call does not wait for one.
    if (!notMade) await untilSlot();
    // Not for a run that makes no call (aborted: the claim was lost, or the worker stops and hands
    // it back; START could not be written): whoever calls it replaces the older runs then.
    if (run.concurrency === 'replace' && !cancel.aborted && !notMade) {
      const tried = await beforeCall(ctx, run, cancel, log, 'replace the older runs', () =>
        replaceOlderRuns(pool, run.jobId),
      );
      // Handed back rather than left to the reaper: the run waited out its whole claim (up to an
      // hour for a long timeout) before its occurrence was called.
      if ('err' in tried) {
        const error = "the job's older runs could not be replaced; call not made";
        notMade = { outcome: 'replace-failed', error, err: tried.err, tries: tried.tries };
      } else if ('answer' in tried) {
        const { replaced, running } = tried.answer;
        if (replaced.length > 0) metrics.runsReplaced.inc(replaced.length);
        // Called only if this attempt is the one left running. Otherwise a run asked for later (a
        // newer occurrence, a trigger or a replay) runs or has been claimed: this one was replaced
        // before its call began, now or already (that run's claim replaced it while this one's
        // START was on its way back, or an earlier try of this replacement whose answer was lost
        // did), or its claim was lost.
        if (running?.id !== run.id || running.attempt !== run.attempt || running.nodeId !== nodeId) {
          callEnded?.(false);
          metrics.runsExecuted.inc({ outcome: 'replaced' });
          log().info(
            { replaced: replaced.includes(run.id) },
            'replaced by a run of the job asked for later, before its call; no call made',
          );
          return;
        }
      }
    }
    // Judged after START and the replacement, which take round trips: the call begins right after.
    notMade ??= whyNotStart(ctx, run, cancel, drainLeftMs);
    if (notMade) {
      callEnded?.(false);
      metrics.runsExecuted.inc({ outcome: notMade.outcome });
      const report = {
        outcome: 'cancelled' as const,
        statusCode: null,
        durationMs: null,
        error: notMade.error,
        responseExcerpt: null,
      };
      // Retried while the claim holds, as a settle write is: a release lost to a failed write left
      // the run to the reaper, whose forgiven expiries are bounded (past them an attempt is charged).
      // When it cannot be written either (PostgreSQL still away), the reaper re-queues the run once
      // its claim expires, as it recovers a worker that died.
      // A replacement that cannot be written may fail on every claim (a lock held past the
      // statement timeout, a plan gone bad): each claim handed the run back, re-queued and
      // announced, for ever. Such hand-backs count with the reaper's forgiven expiries (a run
      // started either way: its claim or its START began it); past FORGIVEN_EXPIRIES the attempt
      // is charged, so the run ends dead as a job whose calls keep killing workers does. A START
      // that cannot be written needs no bound: the run is due once handed back, so whoever claims
      // it next starts it with the claim, without START; nor does a stopping worker's hand-back:
      // it claims nothing more. Nor a claim acknowledged too late: counted, a database coming back
      // from an outage (claims answered seconds late, a pool of dead connections) charged the
      // attempts of every run due meanwhile and buried them (leader-stall-review-blackhole); its
      // lasting causes are the node's load (the claim budget) and a clock estimate running ahead,
      // which the hand-back re-samples (below).
      const counted = notMade.outcome === 'replace-failed' ? FORGIVEN_EXPIRIES : undefined;
      let releaseErr: Error | undefined;
      const released = await release(report, counted).catch((err: unknown) => {
        releaseErr = toError(err);
        return null;
      });
      if (released && notMade.outcome === 'stopping') ctx.handOff?.([released]);
      // Not released: the bound was reached, or the claim was lost (the charge then finds nothing).
      const delay = retryDelayMs(run.failuresBefore + 1, run);
      const charged =
        counted !== undefined && !released && !releaseErr
          ? await fail(report, delay).catch((err: unknown) => {
              releaseErr = toError(err);
              return null;
            })
          : null;
      if (charged?.state === 'dead') metrics.deadLetters.inc();
      // Too late by this worker's estimate of the database clock, which may run ahead (a sample
      // whose round trip was delayed before the database read its clock, a host clock stepped):
      // re-sampled now, at most once a second (a herd's hand-backs share one), rather than at the
      // next periodic sync (30 s), until which every claim of this worker was handed back too.
      // After the hand-back, which need not wait for it (the slot is free already).
      if (notMade.outcome === 'claim-too-late')
        await ctx.clock.sync(pool, LATE_CLAIM_SYNC_AGE_MS).catch(() => undefined);
      log().warn(
        {
          released: Boolean(released),
          charged: charged?.state,
          reason: notMade.error,
          err: notMade.err,
          tries: notMade.tries,
          releaseErr,
        },
        `${NOT_MADE[notMade.outcome]}; ${
          released
            ? 'claim handed back'
            : charged
              ? `its ${counted} forgiven expiries and hand-backs used up: charged as a failed attempt; ${
                  charged.state === 'dead' ? 'the run is dead: attempts exhausted' : `retrying in ${delay} ms`
                }`
              : releaseErr
                ? 'the claim could not be handed back: the reaper re-queues the run once it expires'
                : 'the claim had been lost meanwhile: nothing to hand back'
        }`,
      );
      return;
    }
    // The claim was lost before the call (a pause, an edit, a delete or a `replace` took the run
    // while it waited for its time, or another worker took it over; a drain is whyNotStart's): no
    // call is made, and none is counted as a call whose outcome was discarded (staleCompletions,
    // the HeliosCallsNotRecorded alert), which a pause in a herd counted once per run.
    if (cancel.aborted) {
      callEnded?.(false);
      metrics.runsExecuted.inc({ outcome: 'claim-lost' });
      log().info({ reason: toError(cancel.reason).message }, 'claim lost before its call; no call made');
      return;
    }
    const startedAt = ctx.clock.now();
    if (run.attempt === 1)
      metrics.lateness.observe(Math.max(0, startedAt - run.scheduledFor.getTime()) / 1000);
    // When the call began, recorded as the attempt's start (a run claimed ahead may have waited
    // for a slot after the instant its claim recorded).
    const report = { ...(await ctx.executor.execute(run, cancel)), startedAt: new Date(startedAt) };
    // The call is over: its slot may take the next run while this outcome is written.
    callEnded?.(
      report.outcome !== 'cancelled',
      report.outcome === 'succeeded' && (ctx.writeMayWait?.(run, report) ?? false),
    );
    if (report.durationMs !== null) metrics.httpDuration.observe(report.durationMs / 1000);

    // Judged by the call's outcome, not by the signal: a call that completed just before an abort
    // is settled like any other (its completion is still conditional on the claim).
    if (report.outcome === 'cancelled') {
      const reason: unknown = cancel.reason;
      if (reason instanceof WorkerStoppingError) {
        const released = await release(report);
        if (released) ctx.handOff?.([released]);
        metrics.runsExecuted.inc({ outcome: 'cancelled' });
        log().info({ released: Boolean(released) }, 'call aborted by shutdown; claim handed back');
        return;
      }
      // The claim is gone (replaced, deleted, or expired and taken over): whoever took it records
      // the run. Only the last is an outcome discarded for a run called again (HeliosCallsNotRecorded):
      // a replaced or deleted run is called by no one, as its job's policy or a user asked.
      metrics.runsExecuted.inc({ outcome: reason instanceof ClaimLostError ? 'claim-lost' : 'cancelled' });
      if (!(reason instanceof ClaimLostError) || reason.outcomeWanted) metrics.staleCompletions.inc();
      log().info({ reason: toError(reason).message }, 'call aborted: claim lost');
      return;
    }

    // A call cut by a lost claim after its status arrived keeps that answer (http-executor.ts); its
    // write below is then stale, like any other of a lost claim, and counted so.
    const claimLost = cancel.aborted && cancel.reason instanceof ClaimLostError;
    metrics.runsExecuted.inc({ outcome: claimLost ? 'claim-lost' : report.outcome });
    if (report.outcome === 'succeeded') {
      const completed = await whileClaimed(ctx, run, log, () => ctx.complete(run, report)).catch(
        (err: unknown) => lastCompletion(ctx, run, report, err),
      );
      if (!completed) await staleOrRecorded(ctx, run, log, report.outcome, cancel);
      return;
    }
    const delay = retryDelayMs(run.failuresBefore + 1, run);
    const result = await fail(report, delay);
    if (!result) return await staleOrRecorded(ctx, run, log, report.outcome, cancel);
    if (result.state === 'dead') {
      metrics.deadLetters.inc();
      log().warn(
        { error: report.error, status: report.statusCode },
        report.retryable === false
          ? 'run is dead: its call cannot be made (target refused by the policy, or an invalid request)'
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
      'settling the attempt failed until the claim expired; the reaper recovers it',
    );
  }
}

/**
 * A run claimed ahead of its time: marks it started, after which a pause or an edit no longer
 * withdraws it. `not-started` (no call) when it was withdrawn or its claim lost. A write that fails
 * is tried again while the claim still covers the call ({@link beforeCall}; START is repeatable);
 * past that, `start-failed` (no call): the caller hands the claim back without using up an attempt.
 * Before, the run was left to the reaper, re-queued only once its claim expired (up to an hour
 * late for a long timeout). Calling it unmarked could race a pause. A run marked started and then
 * handed back uncalled (whyNotStart, or start-failed after a try that committed but whose answer
 * was lost) keeps started_at: it is due by then, or within the skew tolerance of it (START marks
 * only a run due by the database clock, within the skew tolerance; an aborted run is not marked),
 * and a pause withdraws only runs not started (jobs.ts WITHDRAW_FUTURE_RUNS), so it keeps it even
 * when handed back still ahead of its time; whoever claims it next calls it without START.
 * One handed back unmarked is STARTed by whoever claims it next.
 *
 * START also checks the run is due by the database clock itself (within the skew tolerance): when
 * this worker's estimate of that clock ran early (a host clock stepped or slewed since the last
 * sample), it says how long is left; the call waits that long, the estimate is re-sampled, and
 * START is asked again. `aborted` when the cancel came during a wait: not started, no call.
 */
async function startWhenDue(
  ctx: AttemptContext,
  run: ClaimedRun,
  cancel: AbortSignal,
  log: () => RunLog,
): Promise<'started' | 'not-started' | 'aborted' | NotMade> {
  for (;;) {
    const tried = await beforeCall(ctx, run, cancel, log, 'mark the run started', () => ctx.start(run));
    if (!('answer' in tried)) {
      if (!('err' in tried)) return 'aborted';
      const error = 'the run could not be marked started; call not made';
      return { outcome: 'start-failed', error, err: tried.err, tries: tried.tries };
    }
    const answer = tried.answer;
    if (answer === true) return 'started';
    if (answer === false) {
      ctx.metrics.runsExecuted.inc({ outcome: 'withdrawn' });
      log().info('run withdrawn (paused, edited or deleted) or its claim lost before its call; no call made');
      return 'not-started';
    }
    ctx.metrics.startsEarly.inc();
    log().warn(
      { dueInMs: Math.round(answer.dueInMs) },
      "not due yet by the database clock (this worker's estimate of it ran early); the call waits",
    );
    void ctx.clock.sync(ctx.pool).catch(() => undefined);
    await sleep(Math.ceil(answer.dueInMs) + 1, undefined, { signal: cancel }).catch(() => undefined);
    if (cancel.aborted) return 'aborted';
  }
}

/**
 * Runs a write the call must follow (START, the replacement), which may be repeated: a failure
 * (PostgreSQL restarting, a deadlock, a pool timeout, an answer lost after a commit) is tried again
 * with a growing pause while a call started after it could still end within the claim. Past that,
 * the last error; `aborted` (no answer, no error) when the cancel came during a pause: no call
 * follows, and the caller hands the claim back or drops it.
 */
async function beforeCall<T>(
  ctx: AttemptContext,
  run: ClaimedRun,
  cancel: AbortSignal,
  log: () => RunLog,
  what: string,
  write: () => Promise<T>,
): Promise<{ answer: T } | { err: Error; tries: number } | { aborted: true }> {
  for (
    let tries = 1, pauseMs = SETTLE_RETRY_MS;
    ;
    tries++, pauseMs = Math.min(SETTLE_RETRY_MAX_MS, pauseMs * 2)
  ) {
    try {
      return { answer: await write() };
    } catch (err) {
      const spareMs = ctx.clock.msLeftUntil(run.claimExpiresAt) - run.timeoutMs;
      if (spareMs <= pauseMs) return { err: toError(err), tries };
      if (tries === 1)
        log().warn({ err: toError(err) }, `could not ${what}; retrying while the claim covers the call`);
      await sleep(pauseMs, undefined, { signal: cancel }).catch(() => undefined);
      if (cancel.aborted) return { aborted: true };
    }
  }
}

/** Why a claimed run's call is not made, its claim handed back. */
interface NotMade {
  readonly outcome: keyof typeof NOT_MADE;
  /** Recorded as the attempt's error. */
  readonly error: string;
  /** The failed write behind it, for the log. */
  readonly err?: Error;
  readonly tries?: number;
}

const NOT_MADE = {
  stopping: 'call not made: the worker stops before its timeout would end',
  'claim-too-late':
    'call not made: the claim had less than its timeout left (its answer came late, or the run waited for a slot)',
  'replace-failed':
    "call not made: the job's older runs could not be replaced while the claim covered the call",
  'start-failed': 'call not made: the run could not be marked started while the claim covered the call',
};

/**
 * Why the call must not start, or undefined when it may: it could not end (time out at the
 * latest) before the claim expires, or before a stopping worker's drain aborts what still runs
 * (`drainLeftMs`). Either way the call could be cut after reaching the target and then be made again
 * by whoever takes the run next; handing the claim back instead costs the run no attempt, and
 * whoever claims it next makes the call.
 */
function whyNotStart(
  ctx: AttemptContext,
  run: ClaimedRun,
  cancel: AbortSignal,
  drainLeftMs: (() => number) | undefined,
): NotMade | undefined {
  // The drain aborted it before its call: its call could not end before the drain's deadline
  // (run-queue.ts, drain()), though its time may not have come yet.
  if (cancel.reason instanceof WorkerStoppingError) {
    return { outcome: 'stopping', error: 'worker stopping before this call could end; call not made' };
  }
  // A claim whose answer arrived late (a network that dropped then retransmitted it, a pause)
  // may expire before the call could end, or have expired and been taken back by the reaper.
  const claimLeftMs = ctx.clock.msLeftUntil(run.claimExpiresAt);
  if (claimLeftMs <= run.timeoutMs) {
    return {
      outcome: 'claim-too-late',
      error: `claim had ${Math.round(claimLeftMs)} ms left when the call would begin, less than the timeout; call not made`,
    };
  }
  const stoppingInMs = drainLeftMs?.() ?? Infinity;
  if (stoppingInMs <= run.timeoutMs) {
    return {
      outcome: 'stopping',
      error: `worker stopping in ${Math.round(stoppingInMs)} ms, less than the timeout; call not made`,
    };
  }
  return undefined;
}

/** A claim handed back too late re-samples the clock estimate if its last sample is this old. */
const LATE_CLAIM_SYNC_AGE_MS = 1000;

/** First pause between tries of a settle write, doubling up to SETTLE_RETRY_MAX_MS. */
const SETTLE_RETRY_MS = 25;
const SETTLE_RETRY_MAX_MS = 1000;

/**
 * Runs a settle write, retrying it with back-off until it succeeds or the claim expires (by our
 * estimate of the database clock). Every settle write is conditional on this node still holding
 * the claim, so retrying is safe: once the reaper has taken the run back, the write changes
 * nothing and reports the claim lost. Throws the last error when the claim expired first.
 */
async function whileClaimed<T>(
  ctx: AttemptContext,
  run: ClaimedRun,
  log: () => RunLog,
  write: () => Promise<T>,
): Promise<T> {
  for (
    let tries = 1, pauseMs = SETTLE_RETRY_MS;
    ;
    tries++, pauseMs = Math.min(SETTLE_RETRY_MAX_MS, pauseMs * 2)
  ) {
    try {
      return await write();
    } catch (err) {
      const leftMs = ctx.clock.msLeftUntil(run.claimExpiresAt);
      if (leftMs <= 0) throw err;
      ctx.metrics.settleRetries.inc();
      if (tries === 1)
        log().warn(
          { err: toError(err), claimLeftMs: Math.round(leftMs) },
          'settle write failed; retrying while the claim holds',
        );
      await sleep(Math.min(pauseMs, leftMs));
    }
  }
}

/**
 * A success whose completion failed until its claim expired (whileClaimed threw `err`) is written
 * once more, waiting for its answer as long as the pool does: while the reaper has not taken the
 * run back, the write (conditional on the claim, not on its deadline) still counts, and a run
 * whose call succeeded is not called again. Each bounded try had been given up on and cancelled
 * in PostgreSQL (db.ts cancelStatement): with the run's row locked until just past the claim (an
 * operator's or a migration's transaction), none was left waiting for the lock, which a statement
 * given up on only client-side had been, committing the moment the lock went, before the reaper;
 * this one waits there. Rethrows `err` when this write fails too.
 */
async function lastCompletion(
  ctx: AttemptContext,
  run: ClaimedRun,
  report: AttemptReport,
  err: unknown,
): Promise<boolean> {
  try {
    const [completed] = await completeSucceededMany(ctx.pool, ctx.nodeId, [{ run, report }]);
    return completed ?? false;
  } catch {
    throw toError(err);
  }
}

/**
 * A settle write found the claim no longer ours. That may be our own doing: a write that failed
 * after its statement committed (its answer lost; retried by whileClaimed, or by a batcher's
 * item-by-item fallback after a failed batch) left the claim settled, and the next try finds
 * nothing to settle. When the attempt carries this outcome, the call was recorded and nothing is
 * discarded. Otherwise the claim was lost (the reaper took the run back) and whoever holds it now
 * calls the run again: counted, since that is a second call. A run replaced (a `replace` run asked
 * for later started) or deleted is called by no one again, so its discarded outcome is not counted:
 * the claim watch said so (ClaimLostError's outcomeWanted) or, when the call ended before the
 * watch noticed, the attempt is recorded as replaced or the run is gone with its job. The look costs a statement only on this rare
 * path.
 */
async function staleOrRecorded(
  ctx: AttemptContext,
  run: ClaimedRun,
  log: () => RunLog,
  outcome: AttemptReport['outcome'],
  cancel: AbortSignal,
): Promise<void> {
  const found = await attemptOutcome(ctx.pool, run.id, run.attempt, ctx.nodeId).catch(() => null);
  const recorded = found?.outcome ?? null;
  if (recorded === outcome) {
    log().info({ outcome }, 'outcome recorded by an earlier try whose answer was lost');
    return;
  }
  const unwanted = cancel.aborted && cancel.reason instanceof ClaimLostError && !cancel.reason.outcomeWanted;
  if (unwanted || recorded === 'replaced' || found?.runGone) {
    log().info({ outcome, recorded }, 'completion discarded: the run was replaced or deleted meanwhile');
    return;
  }
  ctx.metrics.staleCompletions.inc();
  log().warn({ outcome }, 'completion discarded: the claim had been lost');
}
