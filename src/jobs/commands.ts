import type { Logger } from '../observability/logger.js';
import type { CronSchedule } from '../scheduling/cron.js';
import { parseCron } from '../scheduling/cron.js';
import { inTransaction, type Database } from '../store/db.js';
import { databaseClock } from '../store/dispatch.js';
import {
  findJob,
  runSnapshotChanged,
  updateJob,
  withdrawFutureRuns,
  type JobFields,
  type JobRecord,
  type JobRef,
} from '../store/jobs.js';
import { createDueRuns } from './due-occurrences.js';

// Job commands: each does its whole change in one transaction with the job row locked, so the
// dispatcher (which locks due jobs FOR UPDATE SKIP LOCKED) never sees half of it. Each draws one
// line, the database clock once the lock is held: occurrences due up to it follow the job as it
// was (and are created now if the dispatcher has not yet), occurrences after it follow the job as
// it is now. That is what keeps contract item 10 whatever the order of pause, resume and edits.

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
    const boundary = await databaseClock(client);
    const nextRunAt = await createDueRuns(client, current, boundary, options);
    await withdrawFutureRuns(client, current.id, boundary);
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
    const boundary = await databaseClock(client);
    // What fell due before this edit runs as the job was defined then.
    let nextRunAt = await createDueRuns(client, current, boundary, options);
    const reschedule =
      fields.schedule !== current.schedule ||
      fields.timezone !== current.timezone ||
      (fields.enabled && !current.enabled);
    if (reschedule) nextRunAt = schedule.next(boundary);
    if (current.enabled && (!fields.enabled || reschedule || runSnapshotChanged(current, fields))) {
      const earliest = await withdrawFutureRuns(client, current.id, boundary);
      // Same schedule, new snapshot: the withdrawn occurrences are created again, from the new definition.
      if (fields.enabled && !reschedule && earliest && (nextRunAt === null || earliest < nextRunAt)) {
        nextRunAt = earliest;
      }
    }
    return updateJob(client, current.id, { ...fields, nextRunAt });
  });
}
