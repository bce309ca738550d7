import { isUuid } from '../model.js';
import type { Logger } from '../observability/logger.js';
import type { CronSchedule } from '../scheduling/cron.js';
import { parseCron } from '../scheduling/cron.js';
import { inTransaction, type Database } from '../store/db.js';
import { deadLetterState } from '../store/dead-letter-list.js';
import { replayDeadLetter as requeueDeadLetter, type ReplayResult } from '../store/dead-letters.js';
import { databaseClock, databaseNow } from '../store/dispatch.js';
import {
  deleteFinishedRuns,
  deleteJob as deleteJobRow,
  findJob,
  insertJob,
  recopyMisfire,
  runSnapshotChanged,
  updateJob,
  withdrawFutureRuns,
  type JobFields,
  type JobRecord,
  type JobRef,
  type Withdrawal,
} from '../store/jobs.js';
import { createManualRun } from '../store/manual-run.js';
import { createDueRuns } from './due-occurrences.js';

// Job commands: each does its whole change in one transaction with the job row locked, so the
// dispatcher (which locks due jobs FOR UPDATE SKIP LOCKED) never sees half of it. Each draws one
// line, the database clock once the lock is held: occurrences due up to it follow the job as it
// was (and are created now if the dispatcher has not yet), occurrences after it follow the job as
// it is now. That is what keeps contract item 10 whatever the order of pause, resume and edits.

// Every caller (the REST routes, the programmatic API in src/index.ts) validates its input first
// (api/job-input.ts compileJob), then calls one command, then renders what it returns.

/** What the commands need besides the database. */
export interface CommandOptions {
  readonly runsTopic: string;
  /** HELIOS_MISFIRE_THRESHOLD_MS (default 5000), as the dispatcher uses it. */
  readonly misfireThresholdMs: number;
  readonly logger?: Logger;
}

/**
 * Disables a job: occurrences due until now run (created now if the dispatcher lags), runs created
 * ahead of their time and not claimed are withdrawn. Runs already claimed or executing finish.
 * Null when the job does not exist; a paused job is returned unchanged.
 */
export async function pauseJob(
  db: Database,
  ref: JobRef,
  options: CommandOptions,
): Promise<JobRecord | null> {
  return inTransaction(db, async (client) => {
    const current = await findJob(client, ref, true);
    if (!current?.enabled) return current;
    // The withdrawal draws the line, then what fell due up to it is created (no run is on both sides).
    const { boundary } = await withdrawFutureRuns(client, current.id);
    const nextRunAt = await createDueRuns(client, current, boundary, options);
    return updateJob(client, current.id, { ...current, enabled: false, nextRunAt });
  });
}

/**
 * Enables a job: its next run is the first occurrence after now, so occurrences that fell due
 * while it was paused do not fire. On an enabled job the dispatcher parked, tries the schedule
 * again. Null when the job does not exist.
 */
export async function resumeJob(db: Database, ref: JobRef): Promise<JobRecord | null> {
  return inTransaction(db, async (client) => {
    const current = await findJob(client, ref, true);
    // An enabled job with no next run may be parked (scheduleError): a resume tries its schedule again.
    if (!current || (current.enabled && current.nextRunAt !== null)) return current;
    const now = await databaseClock(client);
    let nextRunAt: Date | null = null;
    try {
      nextRunAt = parseCron(current.schedule, current.timezone).next(now);
    } catch {
      // A schedule the dispatcher parked stays parked (scheduleError says why) until it is edited.
    }
    return updateJob(client, current.id, { ...current, enabled: true, nextRunAt });
  });
}

/** A validated change: the job's new fields (all of them) and its parsed schedule. */
export interface JobChange {
  readonly fields: Omit<JobFields, 'nextRunAt'>;
  readonly schedule: CronSchedule;
}

/**
 * Replaces a job's fields. `compile` validates the change against the locked current job (it may
 * throw, which rolls everything back). Runs created ahead of their time follow the edit: they are
 * withdrawn when the job is disabled, rescheduled, or a field runs copy changes, and created again
 * by the dispatcher from the new definition. Null when the job does not exist.
 */
export async function patchJob(
  db: Database,
  ref: JobRef,
  compile: (current: JobRecord) => JobChange,
  options: CommandOptions,
): Promise<JobRecord | null> {
  return inTransaction(db, async (client) => {
    const current = await findJob(client, ref, true);
    if (!current) return null;
    const { fields, schedule } = compile(current);
    const reschedule =
      fields.schedule !== current.schedule ||
      fields.timezone !== current.timezone ||
      (fields.enabled && !current.enabled);
    const withdraw =
      current.enabled && (!fields.enabled || reschedule || runSnapshotChanged(current, fields));
    // A withdrawal draws the line itself (see withdrawFutureRuns), and so does a new misfire policy
    // given to the runs made ahead, which are not withdrawn (recopyMisfire: what falls due after
    // the line follows it); otherwise the clock does.
    let line: Withdrawal;
    if (withdraw) line = await withdrawFutureRuns(client, current.id);
    else if (fields.misfire !== current.misfire)
      line = { boundary: await recopyMisfire(client, current.id, fields.misfire), earliest: null };
    else line = { boundary: await databaseClock(client), earliest: null };
    const { boundary, earliest } = line;
    // What fell due before this edit runs as the job was defined then.
    let nextRunAt = await createDueRuns(client, current, boundary, options);
    if (reschedule) nextRunAt = schedule.next(boundary);
    // Same schedule, new snapshot: the withdrawn occurrences are created again, from the new definition.
    if (fields.enabled && !reschedule && earliest && (nextRunAt === null || earliest < nextRunAt)) {
      nextRunAt = earliest;
    }
    return updateJob(client, current.id, { ...fields, nextRunAt });
  });
}

/**
 * Creates a job; its first run is the first occurrence after the database clock.
 * @throws DuplicateJobNameError when the name is taken (nothing written).
 */
export async function createJob(db: Database, change: JobChange): Promise<JobRecord> {
  return inTransaction(db, async (client) => {
    const now = await databaseNow(client);
    return insertJob(client, { ...change.fields, nextRunAt: change.schedule.next(now) });
  });
}

/**
 * Finished runs a job's delete removes per statement before it deletes the job: an every-second
 * job kept 30 days has 2.6M of them, and one statement cascading them all (with their attempts)
 * comes near the 30 s statement timeout while it holds every row.
 */
export const DELETE_HISTORY_BATCH = 10_000;

/**
 * A job's delete failed after some of its history was deleted: the job and its other runs are as
 * they were. `cause` is what failed.
 */
export class JobDeleteInterruptedError extends Error {
  constructor(
    readonly runsDeleted: number,
    options: { cause: unknown },
  ) {
    super(`the delete stopped after ${runsDeleted} finished runs of the job were deleted`, options);
    this.name = 'JobDeleteInterruptedError';
  }
}

/**
 * Deletes a job with its runs. False when there was no such job. Its history goes first, in
 * statements of {@link DELETE_HISTORY_BATCH} finished runs, each its own transaction; then the job
 * row, in one transaction with what is left (its runs waiting or executing, and runs finished
 * meanwhile), cascading. A job named by its name is deleted only if it still has that name then;
 * if another job has taken the name meanwhile, that one is deleted the same way.
 * @throws JobDeleteInterruptedError when it failed after deleting some history (the job stays).
 */
export async function deleteJob(db: Database, ref: JobRef): Promise<boolean> {
  let runsDeleted = 0;
  try {
    for (;;) {
      const found = await findJob(db, ref);
      if (!found) return false;
      // Each batch starts after the last one's occurrence; runs that finish behind it meanwhile go
      // with the job.
      let after: Date | null = null;
      for (;;) {
        const batch = await inTransaction(db, (client) =>
          deleteFinishedRuns(client, found.id, DELETE_HISTORY_BATCH, after),
        );
        runsDeleted += batch?.deleted ?? 0;
        // Ended when a batch found fewer than it may take, not when it deleted fewer: the leader's
        // pruner (or a replay) may have taken some of the runs it picked meanwhile, and the job's
        // cascade below would then take the whole rest of its history in one statement. A batch
        // that deleted none ends it too: nothing else takes a whole batch (a trigger that skips
        // the deletes would have it try for ever).
        if (batch === null || batch.picked < DELETE_HISTORY_BATCH || batch.deleted === 0) break;
        after = batch.last;
      }
      const deleted = await inTransaction(db, (client) => deleteJobRow(client, found.id, ref.name ?? null));
      // Not deleted: gone, or renamed (a job named by its name): look the name up again.
      if (deleted || ref.id !== undefined) return deleted;
    }
  } catch (err) {
    if (runsDeleted > 0) throw new JobDeleteInterruptedError(runsDeleted, { cause: err });
    throw err;
  }
}

/** What a trigger did: the new run, or why none was created. */
export type TriggerResult =
  | { readonly outcome: 'created'; readonly runId: string }
  /** The job does not exist, or was deleted before its run could be written: nothing written. */
  | { readonly outcome: 'no-job' }
  /** Other triggers of the job kept taking the instant this one stepped to (createManualRun): nothing written. */
  | { readonly outcome: 'conflict' };

/**
 * Creates a run of the job for now (`trigger = 'manual'`) and its dispatch message, together in one
 * statement (its own transaction: the statement's answer to a job deleted meanwhile is a foreign
 * key error, which would abort an enclosing transaction); a second statement, rarely a few, only
 * when another trigger took its instant (createManualRun). Paused jobs can be triggered.
 */
export async function triggerJob(
  db: Database,
  ref: JobRef,
  options: Pick<CommandOptions, 'runsTopic'>,
): Promise<TriggerResult> {
  const job = await findJob(db, ref);
  if (!job) return { outcome: 'no-job' };
  const made = await createManualRun(db, job.id, options.runsTopic);
  if (made.runId !== null) return { outcome: 'created', runId: made.runId };
  return { outcome: made.why === 'no-job' ? 'no-job' : 'conflict' };
}

/** What a replay did: the re-queued run, or why nothing was. */
export type ReplayOutcome =
  | ({ readonly outcome: 'replayed' } & ReplayResult)
  | { readonly outcome: 'no-dead-letter' }
  | { readonly outcome: 'already-replayed' };

/**
 * Re-queues a dead run as a new attempt due now with a fresh attempt budget, marks its dead
 * letter replayed and announces the attempt, in one transaction (store/dead-letters.ts).
 */
export async function replayDeadLetter(
  db: Database,
  deadLetterId: string,
  options: Pick<CommandOptions, 'runsTopic'>,
): Promise<ReplayOutcome> {
  if (!isUuid(deadLetterId)) return { outcome: 'no-dead-letter' };
  const result = await requeueDeadLetter(db, deadLetterId, options);
  if (result) return { outcome: 'replayed', ...result };
  // Read after the replay's transaction: only to tell the caller which of the two it was.
  const state = await deadLetterState(db, deadLetterId);
  return state === null ? { outcome: 'no-dead-letter' } : { outcome: 'already-replayed' };
}
