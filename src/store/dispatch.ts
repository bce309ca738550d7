import type { Queryable } from './db.js';
import type { MisfirePolicy } from '../model.js';

/** A job due for dispatch, locked by the dispatch transaction. */
export interface DueJob {
  readonly id: string;
  readonly schedule: string;
  readonly timezone: string;
  readonly misfire: MisfirePolicy;
  readonly maxCatchUp: number;
  readonly nextRunAt: Date;
  /** The stored size of the job's target, which every run copies (pg_column_size). */
  readonly targetBytes: number;
}

/** About what a run costs to write besides its copy of the target: its row and its outbox row. */
export const RUN_ROW_BYTES = 400;

/**
 * Most bytes one statement creating runs writes, counting each run's copy of its job's target. A
 * target can be 250 KiB (a 64 KiB body and headers): 10,001 runs of one catch-up with a 192 KiB
 * target were 1.9 GB in one statement, past the 30 s statement timeout, on every try.
 */
export const MAX_INSERT_BYTES = 16 * 1024 * 1024;

/** How many runs of a job whose target takes `targetBytes` one statement may create. */
export function runsPerStatement(targetBytes: number): number {
  return Math.max(1, Math.floor(MAX_INSERT_BYTES / (RUN_ROW_BYTES + targetBytes)));
}

const DUE_JOB_COLUMNS = `id, schedule, timezone, misfire, max_catch_up AS "maxCatchUp", next_run_at AS "nextRunAt",
         pg_column_size(target) AS "targetBytes", now() AS "dbNow"`;

/**
 * Enabled jobs due within the lookahead and not yet late (next_run_at within the misfire
 * threshold of now()), locked, oldest first. $1 = lookahead ms, $2 = batch size, $3 = threshold ms.
 */
const SELECT_DUE_ON_TIME = `
  SELECT ${DUE_JOB_COLUMNS}
  FROM jobs
  WHERE enabled AND next_run_at <= now() + $1 * interval '1 millisecond'
    AND next_run_at >= now() - $3 * interval '1 millisecond'
  ORDER BY next_run_at
  LIMIT $2
  FOR UPDATE SKIP LOCKED`;

/** Enabled jobs whose next_run_at is later than the threshold: a catch-up. $1 = batch size, $2 = threshold ms. */
const SELECT_DUE_LATE = `
  SELECT ${DUE_JOB_COLUMNS}
  FROM jobs
  WHERE enabled AND next_run_at < now() - $2 * interval '1 millisecond'
  ORDER BY next_run_at
  LIMIT $1
  FOR UPDATE SKIP LOCKED`;

/**
 * Returns at most `limit` due jobs, locked, and the database's clock, the one clock for
 * scheduling decisions. Jobs still on time come first, then late ones (a catch-up after an
 * outage), each oldest first: a catch-up goes in passes (see Dispatcher), and an order by
 * next_run_at alone put every pass of it before a job falling due meanwhile, which then waited
 * for the whole catch-up and was itself late, a misfire while a leader led. now() is the
 * transaction's: both statements draw the same line, and the planner its `cutoff` from it.
 */
export async function selectDueJobs(
  db: Queryable,
  lookaheadMs: number,
  limit: number,
  misfireThresholdMs: number,
) {
  type Row = DueJob & { dbNow: Date };
  const onTime = (await db.query<Row>(SELECT_DUE_ON_TIME, [lookaheadMs, limit, misfireThresholdMs])).rows;
  const late =
    onTime.length < limit
      ? (await db.query<Row>(SELECT_DUE_LATE, [limit - onTime.length, misfireThresholdMs])).rows
      : [];
  const jobs = [...onTime, ...late];
  const now = jobs[0]?.dbNow ?? (await databaseNow(db));
  return { now, jobs };
}

export async function databaseNow(db: Queryable): Promise<Date> {
  const { rows } = await db.query<{ now: Date }>('SELECT now() AS now');
  return rows[0]!.now;
}

/**
 * The database's clock as this statement runs, not as its transaction began (`now()`): a command
 * that waited for a row lock must not draw its line at an instant already past.
 */
export async function databaseClock(db: Queryable): Promise<Date> {
  const { rows } = await db.query<{ now: Date }>('SELECT clock_timestamp() AS now');
  return rows[0]!.now;
}

/**
 * The first-attempt message announcing a run, built from a row with `id, job_id, scheduled_for,
 * not_before, timeout_ms, concurrency` (the dispatcher's and the manual trigger's runs). Workers parse it in
 * execution/run-message.ts.
 */
export const FIRST_ATTEMPT_MESSAGE = `jsonb_build_object('runId', id, 'jobId', job_id, 'attempt', 1,
                            'scheduledFor', scheduled_for, 'notBefore', not_before,
                            'timeoutMs', timeout_ms, 'concurrency', concurrency)`;

/**
 * The `runs` columns a run copies from its job as they are, besides max_attempts (RunSnapshot in
 * model.ts, and `misfire`). `misfire` is copied for the workers' misfire test of runs made before
 * an outage (runs.ts misfiredAtClaim) but is not in RunSnapshot: an edit of it alone withdraws
 * nothing (the runs made ahead would then wait for a leader to be made again, and one back too late
 * would drop occurrences healthy workers would have run); it changes their copy in place instead
 * (jobs.ts recopyMisfire).
 */
const COPIED_COLUMNS = ['target', 'timeout_ms', 'backoff_ms', 'backoff_multiplier', 'concurrency', 'misfire'];

/**
 * The `runs` columns a run copies from its job, and the same columns of the job aliased `j`, in the
 * same order: every statement that creates a run from a job uses both.
 */
export const RUN_SNAPSHOT_COLUMNS = ['max_attempts', ...COPIED_COLUMNS].join(', ');
export const JOB_SNAPSHOT_VALUES = ['max_attempts', ...COPIED_COLUMNS].map((c) => `j.${c}`).join(', ');

/**
 * A SET clause (of `runs`, with the job aliased `j`) that takes a fresh copy of the job into a run,
 * max_attempts aside (a replay budgets it from the run's attempts).
 */
export const RECOPY_JOB = `(${COPIED_COLUMNS.join(', ')}) = (${COPIED_COLUMNS.map((c) => `j.${c}`).join(', ')})`;

/**
 * Creates one queued run per (job, occurrence) with a snapshot of the job, skipping occurrences
 * that already have a run, and one outbox row per created run, in one statement.
 * $1 = job ids, $2 = occurrences (parallel arrays), $3 = fencing token (NULL: created through the API),
 * $4 = topic.
 */
const CREATE_RUNS = `
  WITH created AS (
    INSERT INTO runs (job_id, scheduled_for, trigger, state, ${RUN_SNAPSHOT_COLUMNS}, not_before, created_epoch)
    SELECT j.id, o.scheduled_for, 'schedule', 'queued', ${JOB_SNAPSHOT_VALUES}, o.scheduled_for, $3
    FROM unnest($1::uuid[], $2::timestamptz[]) AS o (job_id, scheduled_for)
    JOIN jobs j ON j.id = o.job_id
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING id, job_id, scheduled_for, not_before, timeout_ms, concurrency
  )
  INSERT INTO outbox (topic, key, payload)
  SELECT $4, job_id::text, ${FIRST_ATTEMPT_MESSAGE}
  FROM created`;

/**
 * Returns how many runs were created (existing occurrences are not counted). At most
 * `perStatement` runs go in one statement (see runsPerStatement).
 */
export async function createRuns(
  db: Queryable,
  occurrences: { jobId: string; scheduledFor: Date }[],
  token: bigint | null,
  topic: string,
  perStatement = Number.POSITIVE_INFINITY,
): Promise<number> {
  let created = 0;
  for (let from = 0; from < occurrences.length; from += perStatement) {
    const part = occurrences.slice(from, from + perStatement);
    const { rowCount } = await db.query(CREATE_RUNS, [
      part.map((o) => o.jobId),
      part.map((o) => o.scheduledFor),
      token?.toString() ?? null,
      topic,
    ]);
    created += rowCount ?? 0;
  }
  return created;
}

/** Moves each job's next_run_at forward. $1 = job ids, $2 = next instants (NULL = none). */
const ADVANCE_JOBS = `
  UPDATE jobs SET next_run_at = u.next_run_at
  FROM unnest($1::uuid[], $2::timestamptz[]) AS u (id, next_run_at)
  WHERE jobs.id = u.id`;

export async function advanceJobs(db: Queryable, updates: { id: string; nextRunAt: Date | null }[]) {
  if (updates.length === 0) return;
  await db.query(ADVANCE_JOBS, [updates.map((u) => u.id), updates.map((u) => u.nextRunAt)]);
}

/** Parks jobs whose schedule cannot be evaluated. $1 = job ids, $2 = errors (parallel). */
const PARK_JOBS = `
  UPDATE jobs SET next_run_at = NULL, schedule_error = left(u.error, 1000)
  FROM unnest($1::uuid[], $2::text[]) AS u (id, error)
  WHERE jobs.id = u.id`;

/**
 * Parks jobs whose schedule cannot be evaluated: no next run, and the reason recorded on the job
 * (`schedule_error`, shown by the API) until an edit or a resume gives it a next run again.
 */
export async function parkJobs(db: Queryable, parked: { id: string; error: string }[]) {
  if (parked.length === 0) return;
  await db.query(PARK_JOBS, [parked.map((p) => p.id), parked.map((p) => p.error)]);
}

/** Milliseconds until the earliest enabled job is due (by the database clock); null if none. */
const NEXT_DUE = `
  SELECT (extract(epoch FROM min(next_run_at) - now()) * 1000)::float8 AS "inMs"
  FROM jobs WHERE enabled AND next_run_at IS NOT NULL`;

export async function msUntilNextDue(db: Queryable): Promise<number | null> {
  const { rows } = await db.query<{ inMs: number | null }>(NEXT_DUE);
  return rows[0]?.inMs ?? null;
}
