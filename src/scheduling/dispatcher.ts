import { performance } from 'node:perf_hooks';
import { setImmediate as nextTurn } from 'node:timers/promises';
import { isServerError, type Database } from '../store/db.js';
import type { Leadership } from '../coordination/election.js';
import type { Logger } from '../observability/logger.js';
import type { Metrics } from '../observability/metrics.js';
import type { Notifications } from '../store/notifications.js';
import type { MisfirePolicy } from '../model.js';
import { NotLeaderError, toError, type StaleFencingTokenError } from '../errors.js';
import { runLeaderLoop } from '../coordination/leader-loop.js';
import { inFencedTransaction } from '../store/fence.js';
import {
  advanceJobs,
  createRuns,
  MAX_INSERT_BYTES,
  msUntilNextDue,
  parkJobs,
  RUN_ROW_BYTES,
  runsPerStatement,
  selectDueJobs,
} from '../store/dispatch.js';
import { parseCron, type CronSchedule } from './cron.js';
import { planOccurrences, type OccurrencePlan } from './occurrences.js';

export interface DispatcherOptions {
  readonly pool: Database;
  readonly leadership: Leadership;
  readonly notifications: Notifications;
  readonly runsTopic: string;
  /** Runs are created this long before they are due (HELIOS_DISPATCH_LOOKAHEAD_MS, default 5500). */
  readonly lookaheadMs: number;
  /** Jobs per dispatch transaction (HELIOS_DISPATCH_BATCH, default 500). */
  readonly batchSize: number;
  /** Occurrences older than this when seen are misfires (see planOccurrences); default 5000 ms. */
  readonly misfireThresholdMs: number;
  readonly logger: Logger;
  readonly metrics: Metrics;
  /** Called when the fence rejected a write: a newer leader exists. */
  readonly onFenced: (err: StaleFencingTokenError) => void;
  /**
   * Called when PostgreSQL answered a pass's transaction: it committed, or the server refused it
   * with an error of its own (read-only, a full disk: every node would meet the same). Either way
   * the leader's connection works; the leader's stall watch counts these.
   */
  readonly onDatabaseAnswered?: () => void;
  /**
   * Fault injection for tests of the fence: awaited after the leadership check and before the
   * fenced transaction, i.e. where a real GC pause or SIGSTOP would hurt most.
   */
  readonly beforeWrite?: () => Promise<void>;
}

/** Longest sleep between passes even when no job is due soon (a safety net for lost wake-ups). */
const MAX_SLEEP_MS = 1000;

/**
 * Most runs one pass creates: a catch-up is cut between jobs into passes of at most this many
 * runs, and of at most MAX_INSERT_BYTES counting each run's copy of its job's target; a job whose
 * plan alone is larger goes alone, in statements of that size. A plan is at most maxCatchUp
 * (10,000) + 1,000 occurrences; 500 jobs of them would be 5.5 million rows in one statement, and
 * tens of seconds of cron maths (3–40 µs an occurrence here). The planning happens between two
 * statements of the pass's transaction, which PostgreSQL ends after 5 s idle
 * (idle_in_transaction_session_timeout, store/db.ts): 5,000 runs are well under a second here,
 * leaving room for a loaded machine.
 */
export const MAX_RUNS_PER_PASS = 5_000;

/**
 * Longest stretch of cron maths before the event loop gets a turn. The leader's lease keep-alives
 * go out on the same loop (a third of the TTL apart): a pass planning a catch-up without a turn
 * outlasted the lease, and every next leader met the same pass.
 */
const PLAN_SLICE_MS = 20;

/** Parsed schedules the dispatcher keeps (≈83 KB each, see Dispatcher.schedule): ≈21 MB. */
const MAX_CACHED_SCHEDULES = 256;

/**
 * The leader's loop: turns due occurrences into runs and outbox rows, in fenced transactions,
 * then sleeps until the next job is due (minus the lookahead) or a job changes.
 */
export class Dispatcher {
  private readonly schedules = new Map<string, CronSchedule>();

  constructor(private readonly options: DispatcherOptions) {}

  /** Runs until leadership ends; never rejects. */
  async run(): Promise<void> {
    const { leadership, logger, notifications, lookaheadMs, metrics, onFenced } = this.options;
    await runLeaderLoop({
      leadership,
      name: 'dispatch',
      pass: async () => {
        // Read first: a job change committed while this pass reads the jobs ends the sleep below.
        const seen = notifications.seen('helios_jobs');
        const { jobs, full } = await this.dispatchBatch();
        if (full) return; // more due jobs are waiting
        const untilDue = await msUntilNextDue(this.options.pool);
        const sleepMs = untilDue === null ? MAX_SLEEP_MS : Math.min(MAX_SLEEP_MS, untilDue - lookaheadMs);
        // A due job that another transaction holds locked must not turn this into a busy loop.
        await notifications.wait(
          'helios_jobs',
          Math.max(sleepMs, jobs === 0 ? 20 : 0),
          leadership.signal,
          seen,
        );
      },
      wait: (ms, signal) => notifications.wait('helios_jobs', ms, signal),
      maxBackoffMs: 2000,
      onFenced,
      logger,
      metrics,
    });
  }

  /** One fenced transaction over at most `batchSize` due jobs. */
  private async dispatchBatch(): Promise<{ jobs: number; full: boolean }> {
    const { pool, leadership, lookaheadMs, batchSize, misfireThresholdMs, metrics, runsTopic } = this.options;
    if (!leadership.isValid()) throw new NotLeaderError('leadership ended before dispatch');
    await this.options.beforeWrite?.();
    const stopTimer = metrics.dispatchDuration.startTimer();
    const pass = inFencedTransaction(pool, leadership, async (client) => {
      const { now, jobs } = await selectDueJobs(client, lookaheadMs, batchSize, misfireThresholdMs);
      if (jobs.length === 0)
        return {
          jobs: 0,
          created: 0,
          parked: 0,
          misfired: new Map<MisfirePolicy, number>(),
          cutShort: false,
        };
      const horizon = new Date(now.getTime() + lookaheadMs);
      const occurrences: { jobId: string; scheduledFor: Date }[] = [];
      const advances: { id: string; nextRunAt: Date | null }[] = [];
      const parked: { id: string; error: string }[] = [];
      // Jobs sharing a schedule and a due instant (a herd) share one plan: the cron maths is the
      // leader's main CPU cost inside the transaction, which holds row locks while it runs.
      const plans = new Map<string, OccurrencePlan>();
      // Jobs found late, by misfire policy; counted once the transaction commits (a pass that
      // fails is done again and counts then).
      const misfired = new Map<MisfirePolicy, number>();
      let cutShort = false;
      let passBytes = 0;
      let largestTarget = 0;
      let lateTaken = false;
      let sliceFrom = performance.now();
      for (const job of jobs) {
        // The jobs left out stay due, locked until this commits; the next pass takes them first.
        if (occurrences.length >= MAX_RUNS_PER_PASS || passBytes >= MAX_INSERT_BYTES) {
          cutShort = true;
          break;
        }
        if (performance.now() - sliceFrom > PLAN_SLICE_MS) {
          await nextTurn();
          if (!leadership.isValid()) throw new NotLeaderError('leadership ended while planning a dispatch');
          sliceFrom = performance.now();
        }
        let plan;
        try {
          const key = `${job.timezone}\u0000${job.schedule}\u0000${job.nextRunAt.getTime()}\u0000${job.misfire}\u0000${job.maxCatchUp}`;
          plan = plans.get(key);
          if (!plan) {
            plan = planOccurrences(this.schedule(job), job, now, horizon, misfireThresholdMs);
            plans.set(key, plan);
          }
        } catch (err) {
          // A schedule that cannot be evaluated must not block every other job: park this one,
          // with the reason on the job, where the API shows it (an edit or a resume unparks it).
          const error = toError(err);
          this.options.logger.error({ err: error, job: job.id }, 'cannot evaluate schedule; job parked');
          parked.push({ id: job.id, error: error.message });
          continue;
        }
        // A plan that does not fit is left for the next pass. There it is the first job of its
        // kind (on-time jobs come first, then late ones, each oldest first), and the first of each
        // kind goes whole, however large (its statements cut to size below): on-time jobs ahead of
        // a late one cannot keep it out pass after pass. Cutting a plan instead, the job due again
        // from its first occurrence not created, lost occurrences: that one was then late, queued
        // behind every older late job, and planned again by the misfire rule from a later cutoff.
        const runBytes = RUN_ROW_BYTES + job.targetBytes;
        const planBytes = plan.fire.length * runBytes;
        const late = job.nextRunAt.getTime() < now.getTime() - misfireThresholdMs;
        const firstOfItsKind = late ? !lateTaken : occurrences.length === 0;
        if (
          !firstOfItsKind &&
          (occurrences.length + plan.fire.length > MAX_RUNS_PER_PASS ||
            passBytes + planBytes > MAX_INSERT_BYTES)
        ) {
          cutShort = true;
          break;
        }
        if (late) lateTaken = true;
        for (const at of plan.fire) occurrences.push({ jobId: job.id, scheduledFor: at });
        passBytes += planBytes;
        largestTarget = Math.max(largestTarget, job.targetBytes);
        advances.push({ id: job.id, nextRunAt: plan.nextRunAt });
        if (plan.lateFired + plan.dropped > 0)
          misfired.set(job.misfire, (misfired.get(job.misfire) ?? 0) + 1);
        if (plan.dropped > 0) {
          this.options.logger.info({ job: job.id, dropped: plan.dropped, misfire: job.misfire }, 'misfired');
        }
      }
      // One statement unless the pass is a single job larger than a pass (a big catch-up of a big
      // target): its runs then go in statements of MAX_INSERT_BYTES, each within its timeout.
      const created = await createRuns(
        client,
        occurrences,
        leadership.token,
        runsTopic,
        runsPerStatement(largestTarget),
      );
      await advanceJobs(client, advances);
      await parkJobs(client, parked);
      return { jobs: jobs.length, created, parked: parked.length, misfired, cutShort };
    });
    const result = await this.answered(pass);
    stopTimer();
    if (result.created > 0) metrics.runsCreated.inc({ state: 'queued' }, result.created);
    if (result.parked > 0) metrics.jobsParked.inc(result.parked);
    for (const [policy, count] of result.misfired) metrics.misfires.inc({ policy }, count);
    return { jobs: result.jobs, full: result.jobs === batchSize || result.cutShort };
  }

  /** Reports to onDatabaseAnswered when the transaction committed or PostgreSQL refused it itself. */
  private async answered<T>(transaction: Promise<T>): Promise<T> {
    try {
      const result = await transaction;
      this.options.onDatabaseAnswered?.();
      return result;
    } catch (err) {
      if (isServerError(err)) this.options.onDatabaseAnswered?.();
      throw err;
    }
  }

  /**
   * Parsed schedules are cached per (expression, zone), a job edit changing the key; the least
   * recently used goes first once MAX_CACHED_SCHEDULES are kept. A parsed schedule held croner's
   * 10,000-entry year table (≈83 KB; now one table shared by all, see cron.ts), and a leader
   * leading for months meets every schedule its users ever gave a job: kept until 50,000 of them,
   * that was up to 4 GB. Parsing one again costs ≈30 µs, and the jobs of a herd share one parse
   * per pass (see the plans above).
   */
  private schedule(job: { schedule: string; timezone: string }): CronSchedule {
    const key = `${job.timezone}\u0000${job.schedule}`;
    let schedule = this.schedules.get(key);
    if (schedule) {
      this.schedules.delete(key);
    } else {
      schedule = parseCron(job.schedule, job.timezone);
      if (this.schedules.size >= MAX_CACHED_SCHEDULES)
        this.schedules.delete(this.schedules.keys().next().value!);
    }
    this.schedules.set(key, schedule);
    return schedule;
  }
}
