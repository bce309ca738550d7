import { isStatementCancelled, type Database, type DbClient } from '../store/db.js';
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Leadership } from '../coordination/election.js';
import { NotLeaderError, type StaleFencingTokenError } from '../errors.js';
import { runLeaderLoop } from '../coordination/leader-loop.js';
import type { Logger } from '../observability/logger.js';
import type { Metrics } from '../observability/metrics.js';
import { NO_RUN_LINE_LIMIT, type RunLines } from '../observability/run-lines.js';
import {
  failAttempt,
  msUntilNextExpiry,
  selectExpiredRuns,
  type AttemptReport,
  type ExpiredRun,
  type ExpiryOptions,
  type Topics,
} from '../store/attempts.js';
import { forgiveExpiredClaims } from '../store/releases.js';
import type { RunMessage } from '../model.js';
import { inFencedTransaction } from '../store/fence.js';
import { retryDelayMs } from './backoff.js';

/**
 * Expired claims of one run re-queued without using up an attempt (see forgiveExpiredClaims);
 * later ones count as failed attempts.
 */
export const FORGIVEN_EXPIRIES = 2;

/** The sleep after a pass that left an expired claim to a later one (another transaction held it). */
const HELD_RETRY_MS = 100;

/**
 * How long one statement of a reaper pass may run (ReaperOptions.statementTimeoutMs). A pass holds
 * the fence row from its first statement to its commit, and every dispatch pass waits for it
 * meanwhile: a statement slowed by a bad plan (12–21 s, see SELECT_EXPIRED), a lock or a struggling
 * server delayed a herd's dispatch past its due time. Cancelled at 2 s, a pass gives the fence back
 * while the lookahead (5.5 s) still covers the runs it delayed; the reaper tries again after its
 * back-off. Its usual statements take milliseconds; re-queuing a thousand claims, tens.
 */
export const REAPER_STATEMENT_TIMEOUT_MS = 2000;

/**
 * How long after its start a pass stops sending the statements of charged runs (one transaction's
 * statements each: about 1 ms apiece here, 100 runs 110–130 ms) and commits what it did: the
 * statement timeout bounds each statement, this the pass (give or take one charged run's
 * statements). The runs left stay expired; the next pass, at once, takes them first.
 */
const PASS_BUDGET_MS = 1000;

/**
 * After a pass's select of expired claims, never-started ones included, was cancelled at its
 * statement timeout (a plan gone bad, as SELECT_EXPIRED's once was), the passes leave those out
 * for this long, doubled with each such pass in a row up to UNSTARTED_HOLD_MAX_MS: the claims past
 * their deadline are still taken (never-started ones too, once their deadline passes), instead of
 * every pass being cancelled.
 */
const UNSTARTED_HOLD_MS = 5000;
const UNSTARTED_HOLD_MAX_MS = 60_000;

/**
 * Whether the reaper's passes leave never-started claims out (UNSTARTED_HOLD_MS). One per node,
 * kept across its epochs: a plan that stays bad would otherwise cost each new epoch of the same
 * node one cancelled pass (2 s of dispatch held) before the hold took effect again.
 */
export class UnstartedClaimsHold {
  private until = 0;
  private lengthMs = 0;

  /** `firstMs`: the first hold's length (tests shorten it). */
  constructor(private readonly firstMs = UNSTARTED_HOLD_MS) {}

  get active(): boolean {
    return performance.now() < this.until;
  }

  /** The select with never-started claims was cancelled: holds them out, twice as long as the last time. */
  extend(): number {
    this.lengthMs = Math.min(UNSTARTED_HOLD_MAX_MS, this.lengthMs * 2 || this.firstMs);
    this.until = performance.now() + this.lengthMs;
    return this.lengthMs;
  }

  /** A pass took never-started claims within its timeout: the next hold starts short again. */
  passed(): void {
    this.lengthMs = 0;
  }
}

/** The statement a pass is at, and since when (performance.now()): a cancel is told by both. */
interface PassStep {
  name: 'fence' | 'select' | 'forgive' | 'charge';
  since: number;
}

/** Options of {@link Reaper}. */
export interface ReaperOptions {
  readonly pool: Database;
  readonly leadership: Leadership;
  readonly topics: Topics;
  /** Longest sleep between passes (HELIOS_REAPER_INTERVAL_MS, default 1000). */
  readonly intervalMs: number;
  /** Runs past their claim's deadline per fenced transaction; default 100. */
  readonly batchSize?: number;
  /**
   * Runs claimed ahead and never started (`unstartedAfterMs`) per fenced transaction, taken when
   * fewer than `batchSize` were past their deadline; default 1000. All are re-queued in one
   * statement (≈0.1 ms of PostgreSQL's time each), not one transaction's statements each.
   */
  readonly unstartedBatchSize?: number;
  /**
   * A run claimed ahead whose call has not begun this long after it fell due is taken back too
   * (store/attempts.ts, claimOver): the workers' claim grace (HELIOS_CLAIM_GRACE_MS). Default:
   * only claims past their deadline.
   */
  readonly unstartedAfterMs?: number;
  /** Each statement of a pass is cancelled past this; default REAPER_STATEMENT_TIMEOUT_MS. */
  readonly statementTimeoutMs?: number;
  /** The node's hold of never-started claims, kept across its epochs; default: this reaper's own. */
  readonly unstartedHold?: UnstartedClaimsHold;
  readonly logger: Logger;
  /** The node's budget of lines about single runs. Default: no limit. */
  readonly runLines?: RunLines;
  readonly metrics: Metrics;
  /** Called when the fence rejected a write: a newer leader exists. */
  readonly onFenced: (err: StaleFencingTokenError) => void;
  /**
   * Announces runs the reaper re-queued at once (forgiven) to the workers other than `claimedBy`,
   * whose claim they were taken from, after the pass commits (worker.ts's hand-off channel). Their
   * Kafka announcement goes to the partition of their job, whose consumer may be that same worker:
   * frozen, cut off or still starting again, it would leave them to the others' polling fallback,
   * `HELIOS_POLL_OVERDUE_MS` later. Must not throw. Default: none.
   */
  readonly handOff?: (messages: RunMessage[], claimedBy: string | null) => void;
}

/**
 * The leader's loop for stranded work (contract item 6): a run still `running` past its claim
 * deadline belonged to a worker that died, hung or was partitioned. Its first FORGIVEN_EXPIRIES
 * expiries re-queue it at once without using up an attempt (the target did not fail); after
 * that it goes back to `queued` as the next attempt (with backoff and an outbox row) or, with no
 * attempt left, to `dead`. Each pass is one fenced transaction, so a deposed leader cannot
 * re-queue anything.
 *
 * A worker that is merely slow cannot be reaped wrongly: its call is aborted at the run's
 * timeout, which the claim deadline exceeds by the grace period. A paused worker that wakes up
 * after being reaped finds its completion rejected (it is conditional on the claim).
 */
export class Reaper {
  private readonly unstartedHold: UnstartedClaimsHold;

  constructor(private readonly options: ReaperOptions) {
    this.unstartedHold = options.unstartedHold ?? new UnstartedClaimsHold();
  }

  /** Runs until leadership ends; never rejects. */
  async run(): Promise<void> {
    const { leadership, logger, pool, intervalMs, metrics, onFenced } = this.options;
    const pause = (ms: number, signal: AbortSignal) =>
      sleep(ms, undefined, { signal }).catch(() => undefined);
    await runLeaderLoop({
      leadership,
      name: 'reaper',
      pass: async () => {
        const { reaped, full } = await this.reapBatch();
        if (full) return;
        const untilExpiry = reaped > 0 ? 0 : await msUntilNextExpiry(pool, this.expiry());
        // A claim already expired that this pass did not take is held by another transaction (a
        // worker's batch, or a command holding its job for up to its lock patience): look again soon,
        // not every 10 ms.
        const sleepMs =
          untilExpiry === null
            ? intervalMs
            : Math.min(intervalMs, untilExpiry <= 0 ? HELD_RETRY_MS : Math.max(untilExpiry, 10));
        await pause(sleepMs, leadership.signal);
      },
      wait: pause,
      maxBackoffMs: 5000,
      onFenced,
      logger,
      metrics,
    });
  }

  /** Which claims are over (claimOver): never-started ones only while they are not held back. */
  private expiry() {
    return { unstartedAfterMs: this.unstartedHold.active ? undefined : this.options.unstartedAfterMs };
  }

  private unstartedBatchSize(): number {
    return this.options.unstartedBatchSize ?? 1000;
  }

  /**
   * One fenced transaction over at most `batchSize` claims past their deadline and, when those
   * were fewer, at most `unstartedBatchSize` never-started ones (selectExpiredRuns).
   */
  async reapBatch(): Promise<{ reaped: number; full: boolean }> {
    const { pool, leadership, metrics, logger } = this.options;
    const batchSize = this.options.batchSize ?? 100;
    if (!leadership.isValid()) throw new NotLeaderError('leadership ended before reaping');
    const statementTimeoutMs = this.options.statementTimeoutMs ?? REAPER_STATEMENT_TIMEOUT_MS;
    const expiry = this.expiry();
    const step: PassStep = { name: 'fence', since: performance.now() };
    const results = await inFencedTransaction(
      pool,
      leadership,
      (client) => this.reapInTransaction(client, batchSize, expiry, step),
      { statementTimeoutMs },
    ).catch((err: unknown) => {
      // A cancel, and the statement had run as long as the limit: the statement timeout (told
      // apart from an operator's pg_cancel_backend without reading the message, which
      // lc_messages may translate).
      if (!isStatementCancelled(err) || performance.now() - step.since < statementTimeoutMs) throw err;
      metrics.reaperPassesCut.inc({ reason: 'statement_timeout' });
      let held = '';
      if (step.name === 'select' && expiry.unstartedAfterMs !== undefined) {
        held = `; claims never started are left out for ${this.unstartedHold.extend()} ms (taken once past their deadline)`;
      }
      throw new Error(
        `the reaper's ${step.name} statement ran past ${statementTimeoutMs} ms and was cancelled, its pass rolled back (the pass held the fence row, which every dispatch pass waits for)${held}`,
        { cause: err },
      );
    });
    if (results.cutShort > 0) {
      metrics.reaperPassesCut.inc({ reason: 'budget' });
      logger.warn(
        { left: results.cutShort, budgetMs: PASS_BUDGET_MS },
        'reaper pass committed at its budget; the expired runs left go in the next pass',
      );
    }
    // Only a pass whose scan of never-started claims surely ran (it runs when fewer than a batch
    // were past their deadline) tells that the scan is quick again: a pass filled by claims past
    // their deadline skipped it, and would reset the doubling with the plan still bad.
    if (expiry.unstartedAfterMs !== undefined && results.selected < batchSize) this.unstartedHold.passed();
    for (const [claimedBy, messages] of results.handOffs) this.options.handOff?.(messages, claimedBy);
    for (const outcome of results.outcomes) {
      metrics.runsReaped.inc({ to: outcome.charged ? outcome.to : 'queued-uncharged' });
      if (outcome.to === 'dead') metrics.deadLetters.inc();
      const msg = 'claim expired; run recovered';
      if ((this.options.runLines ?? NO_RUN_LINE_LIMIT).allow('warn', msg)) logger.warn(outcome, msg);
    }
    // Either kind may have more waiting: past their deadline (at most batchSize taken) or never
    // started (taken only when fewer than batchSize were past, at most unstartedBatchSize).
    return { reaped: results.outcomes.length, full: results.selected >= batchSize || results.cutShort > 0 };
  }

  /** The statements of one pass, inside its fenced transaction. */
  private async reapInTransaction(
    client: DbClient,
    batchSize: number,
    expiry: ExpiryOptions,
    step: PassStep,
  ) {
    const { topics } = this.options;
    const budgetEnds = performance.now() + PASS_BUDGET_MS;
    const at = (name: PassStep['name']) => Object.assign(step, { name, since: performance.now() });
    at('select');
    const expired = await selectExpiredRuns(client, batchSize, {
      ...expiry,
      unstartedLimit: this.unstartedBatchSize(),
    });
    const outcomes: { id: string; claimedBy: string | null; to: 'queued' | 'dead'; charged: boolean }[] = [];
    const handOffs = new Map<string | null, RunMessage[]>();
    const report = (run: ExpiredRun): AttemptReport => ({
      outcome: 'expired',
      statusCode: null,
      durationMs: null,
      error: run.unstarted
        ? `claimed ahead by ${run.claimedBy ?? 'unknown node'}, its call not begun ${this.options.unstartedAfterMs} ms after it fell due`
        : `claim of ${run.claimedBy ?? 'unknown node'} expired before the attempt completed`,
      responseExcerpt: null,
    });
    // One statement for the runs forgiven (a crashed worker's: thousands in a herd), then one
    // transaction's statements each for those charged.
    const reports = expired.map(report);
    at('forgive');
    const forgiven = await forgiveExpiredClaims(
      client,
      expired.map((run, k) => ({ run, error: reports[k]!.error! })),
      FORGIVEN_EXPIRIES,
      topics.runsTopic,
      expiry,
    );
    let charged = 0;
    let cutShort = 0;
    for (const [k, run] of expired.entries()) {
      const next = forgiven[k];
      if (next) {
        outcomes.push({ id: run.id, claimedBy: run.claimedBy, to: 'queued', charged: false });
        const sameClaimant = handOffs.get(run.claimedBy);
        if (sameClaimant) sameClaimant.push(next);
        else handOffs.set(run.claimedBy, [next]);
        continue;
      }
      // Past the budget the rest are left, locked until the commit, to the next pass.
      if (charged > 0 && performance.now() > budgetEnds) {
        cutShort += 1;
        continue;
      }
      charged += 1;
      at('charge');
      const result = await failAttempt(
        client,
        run,
        { reaper: true },
        reports[k]!,
        retryDelayMs(run.failuresBefore + 1, run),
        topics,
      );
      if (result) outcomes.push({ id: run.id, claimedBy: run.claimedBy, to: result.state, charged: true });
    }
    return { outcomes, selected: expired.length, handOffs, cutShort };
  }
}
