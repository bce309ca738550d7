import { toError } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import { parseCron } from '../scheduling/cron.js';
import { planOccurrences } from '../scheduling/occurrences.js';
import type { Queryable } from '../store/db.js';
import { createRuns, runsPerStatement } from '../store/dispatch.js';
import type { JobRecord } from '../store/jobs.js';

/** What creating a job's due runs outside the dispatcher needs. */
export interface DueRunOptions {
  readonly runsTopic: string;
  /** HELIOS_MISFIRE_THRESHOLD_MS, the dispatcher's own, so both judge lateness alike. */
  readonly misfireThresholdMs: number;
  readonly logger?: Logger;
}

/**
 * Creates the runs of a job's occurrences that fell due by `boundary` but that the dispatcher has
 * not created yet (it lags by milliseconds, by seconds during a failover), from the job's current
 * definition, with the dispatcher's own misfire rules. Returns the job's next occurrence after
 * `boundary` (or its stored next_run_at when nothing was due).
 *
 * A command that changes whether or how a job runs (pause, PATCH) calls this first, with the job
 * row locked, so its effect starts exactly at `boundary`: an occurrence due before it keeps the old
 * definition and runs, one due after follows the new. Without it, a pause that beat the dispatcher
 * to an occurrence already due while the job was enabled silently dropped that occurrence.
 * Runs created here carry no epoch: like manual runs they come from the API, and
 * UNIQUE (job_id, scheduled_for) keeps them from doubling with the dispatcher's.
 */
export async function createDueRuns(
  db: Queryable,
  job: JobRecord,
  boundary: Date,
  options: DueRunOptions,
): Promise<Date | null> {
  const { nextRunAt } = job;
  if (!job.enabled || nextRunAt === null || nextRunAt > boundary) return nextRunAt;
  let plan;
  try {
    const schedule = parseCron(job.schedule, job.timezone);
    plan = planOccurrences(schedule, { ...job, nextRunAt }, boundary, boundary, options.misfireThresholdMs);
  } catch (err) {
    // The dispatcher parks a job whose schedule cannot be evaluated; an edit must still go through.
    options.logger?.warn({ err: toError(err), job: job.id }, 'cannot evaluate schedule; no due runs created');
    return job.nextRunAt;
  }
  const occurrences = plan.fire.map((scheduledFor) => ({ jobId: job.id, scheduledFor }));
  // A catch-up of a job with a large target goes in several statements, each within its timeout.
  const targetBytes = Buffer.byteLength(JSON.stringify(job.target));
  await createRuns(db, occurrences, null, options.runsTopic, runsPerStatement(targetBytes));
  return plan.nextRunAt;
}
