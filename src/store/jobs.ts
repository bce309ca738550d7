import { performance } from 'node:perf_hooks';
import { isDeepStrictEqual } from 'node:util';
import type { DbClient, Queryable } from './db.js';
import { RUN_SNAPSHOT_FIELDS, type MisfirePolicy, type RunSnapshot } from '../model.js';

/**
 * Every column a job is written with (what the API validated and defaulted): the ones its runs
 * copy (RunSnapshot) and the ones only the job has.
 */
export interface JobFields extends RunSnapshot {
  readonly name: string;
  readonly schedule: string;
  readonly timezone: string;
  readonly misfire: MisfirePolicy;
  readonly maxCatchUp: number;
  readonly enabled: boolean;
  readonly nextRunAt: Date | null;
}

export interface JobRecord extends JobFields {
  readonly id: string;
  /** Why the dispatcher parked the job (its schedule could not be evaluated); null otherwise. */
  readonly scheduleError: string | null;
  readonly createdAt: Date;
  readonly updatedAt: Date;
  /** `created_at` as PostgreSQL text, with microseconds (a Date would lose them), for cursors. */
  readonly cursorTs: string;
}

/** A job with this name already exists (unique `jobs.name`). */
export class DuplicateJobNameError extends Error {
  override name = 'DuplicateJobNameError';
  constructor(readonly jobName: string) {
    super(`a job named "${jobName}" already exists`);
  }
}

const COLUMNS = `
  id, name, schedule, timezone, target, timeout_ms AS "timeoutMs", max_attempts AS "maxAttempts",
  backoff_ms AS "backoffMs", backoff_multiplier AS "backoffMultiplier", concurrency, misfire,
  max_catch_up AS "maxCatchUp", enabled, next_run_at AS "nextRunAt", created_at AS "createdAt",
  updated_at AS "updatedAt", created_at::text AS "cursorTs", schedule_error AS "scheduleError"`;

function values(job: JobFields): unknown[] {
  return [
    job.name,
    job.schedule,
    job.timezone,
    JSON.stringify(job.target),
    job.timeoutMs,
    job.maxAttempts,
    job.backoffMs,
    job.backoffMultiplier,
    job.concurrency,
    job.misfire,
    job.maxCatchUp,
    job.enabled,
    job.nextRunAt,
  ];
}

function isUniqueViolation(err: unknown): boolean {
  return typeof err === 'object' && err !== null && (err as { code?: unknown }).code === '23505';
}

/** Inserts a job. $1..$13 = the fields in JobFields order. */
const INSERT = `
  INSERT INTO jobs (name, schedule, timezone, target, timeout_ms, max_attempts, backoff_ms,
                    backoff_multiplier, concurrency, misfire, max_catch_up, enabled, next_run_at)
  VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $9, $10, $11, $12, $13)
  RETURNING ${COLUMNS}`;

/** @throws DuplicateJobNameError */
export async function insertJob(db: Queryable, job: JobFields): Promise<JobRecord> {
  try {
    const { rows } = await db.query<JobRecord>(INSERT, values(job));
    return rows[0]!;
  } catch (err) {
    if (isUniqueViolation(err)) throw new DuplicateJobNameError(job.name);
    throw err;
  }
}

/**
 * Replaces every field of job $1. $2..$14 = the fields in JobFields order. A next run ($14 not
 * NULL) unparks a job the dispatcher had parked.
 */
const UPDATE = `
  UPDATE jobs SET name = $2, schedule = $3, timezone = $4, target = $5::jsonb, timeout_ms = $6,
    max_attempts = $7, backoff_ms = $8, backoff_multiplier = $9, concurrency = $10, misfire = $11,
    max_catch_up = $12, enabled = $13, next_run_at = $14, updated_at = now(),
    schedule_error = CASE WHEN $14::timestamptz IS NULL THEN schedule_error END
  WHERE id = $1
  RETURNING ${COLUMNS}`;

/** Null when the job does not exist. @throws DuplicateJobNameError on a rename onto a taken name. */
export async function updateJob(db: Queryable, id: string, job: JobFields): Promise<JobRecord | null> {
  try {
    const { rows } = await db.query<JobRecord>(UPDATE, [id, ...values(job)]);
    return rows[0] ?? null;
  } catch (err) {
    if (isUniqueViolation(err)) throw new DuplicateJobNameError(job.name);
    throw err;
  }
}

/** One job by id ($1, a uuid) or, when $1 is null, by name ($2); locked when `forUpdate`. */
const SELECT_ONE = `
  SELECT ${COLUMNS} FROM jobs
  WHERE ($1::uuid IS NOT NULL AND id = $1::uuid) OR ($1::uuid IS NULL AND name = $2)`;

/** Finds a job by id or name (see {@link JobRef}); null when there is none. */
export async function findJob(db: Queryable, ref: JobRef, forUpdate = false): Promise<JobRecord | null> {
  const sql = forUpdate ? `${SELECT_ONE} FOR UPDATE` : SELECT_ONE;
  const { rows } = await db.query<JobRecord>(sql, [ref.id ?? null, ref.name ?? null]);
  return rows[0] ?? null;
}

/** A job named by its id or by its name. */
export type JobRef =
  { readonly id: string; readonly name?: never } | { readonly name: string; readonly id?: never };

/** Page of jobs in creation order after cursor ($1 created_at text, $2 id; NULL = start). $3 = limit. */
const LIST = `
  SELECT ${COLUMNS} FROM jobs
  WHERE $1::timestamptz IS NULL OR (created_at, id) > ($1::timestamptz, $2::uuid)
  ORDER BY created_at, id
  LIMIT $3`;

export async function listJobs(
  db: Queryable,
  after: { ts: string; id: string } | null,
  limit: number,
): Promise<JobRecord[]> {
  const { rows } = await db.query<JobRecord>(LIST, [after?.ts ?? null, after?.id ?? null, limit]);
  return rows;
}

/**
 * Deletes up to $2 finished runs of job $1 due after $3 (NULL: from the first), oldest occurrence
 * first (their attempts and dead letters cascade); returns how many it picked and how many went,
 * and the last one's occurrence, where the next batch starts (rather than walking again the index
 * entries of every batch before it). The ids come from the (job_id, scheduled_for) unique index and
 * the delete looks them up by primary key (written as `id IN (subquery)`, the planner hashed the
 * batch against a scan of all of `runs`). The state is checked again on each row the delete locks,
 * so a run a replay re-queued meanwhile stays. A batch of 10,000 runs with an attempt each takes
 * ≈165 ms, most of it the cascades' per-row triggers.
 */
const DELETE_FINISHED_RUNS = `
  WITH picked AS (
    SELECT ARRAY(
      SELECT id FROM runs
      WHERE job_id = $1 AND ($3::timestamptz IS NULL OR scheduled_for > $3)
        AND state IN ('succeeded', 'failed', 'dead', 'skipped')
      ORDER BY scheduled_for
      LIMIT $2) AS ids
  ), gone AS (
    DELETE FROM runs
    WHERE id = ANY ((SELECT ids FROM picked)::uuid[])
      AND state IN ('succeeded', 'failed', 'dead', 'skipped')
    RETURNING scheduled_for)
  SELECT (SELECT cardinality(ids) FROM picked) AS picked, count(*)::int AS deleted,
         max(scheduled_for) AS last
  FROM gone`;

/**
 * Deletes up to `limit` finished runs of a job due after `after`, inside the caller's transaction
 * (see DELETE_FINISHED_RUNS). The job's row is locked first, as its delete locks it: a replay
 * (which locks the job, then its dead letter, then the run) then waits for this batch or this
 * batch for it, never each for the other's row. Null when the job is gone.
 */
export async function deleteFinishedRuns(
  db: DbClient,
  jobId: string,
  limit: number,
  after: Date | null,
): Promise<{ picked: number; deleted: number; last: Date | null } | null> {
  return lockYielding(db, async () => {
    const job = await db.query(`SELECT 1 FROM jobs WHERE id = $1 FOR UPDATE`, [jobId]);
    if (job.rowCount === 0) return null;
    const { rows } = await db.query<{ picked: number; deleted: number; last: Date | null }>(
      DELETE_FINISHED_RUNS,
      [jobId, limit, after],
    );
    return rows[0]!;
  });
}

/**
 * Deletes job $1 (its runs, attempts and dead letters cascade), if it is still named $2 (NULL: any
 * name): the name is checked again on the locked row. A job that had a running run NOTIFYs
 * `helios_runs` (sent at commit), as a `replace` does: the workers' claim watches check at once
 * instead of at their next interval, so a run marked started that waits for its slot (run-queue.ts,
 * start passes) or a call in flight is stopped within a round trip of the delete.
 */
const DELETE = `
  WITH deleted AS (DELETE FROM jobs WHERE id = $1 AND ($2::text IS NULL OR name = $2) RETURNING id)
  SELECT count(*)::int AS deleted,
         bool_or(CASE WHEN EXISTS (SELECT 1 FROM runs r WHERE r.job_id = d.id AND r.state = 'running')
                      THEN pg_notify('helios_runs', d.id::text) IS NULL END) AS notified
  FROM deleted d`;

/**
 * True when the job was deleted (false when it was gone or renamed). Inside the command's
 * transaction, as one yielding try (lockYielding): the delete locks the job's row, then its
 * cascade locks the runs in its plan's order, and a worker's batch may hold one of them while it
 * waits for another the cascade took (or for one a writer finished while the batch waited for it:
 * the batch keeps that row locked). A try that waits too long lets go of all of it and starts
 * again.
 */
export async function deleteJob(db: DbClient, id: string, name: string | null = null): Promise<boolean> {
  return lockYielding(db, async () => {
    const { rows } = await db.query<{ deleted: number }>(DELETE, [id, name]);
    return (rows[0]?.deleted ?? 0) > 0;
  });
}

/**
 * How long a command (a pause, an edit, a delete) waits for a run another statement holds before
 * it lets go of the runs it locked and tries again. A worker's claim, START or completion batch
 * locks its runs in its plan's order (by id when the plan looks each run up by key, in physical
 * order when it scans a small table), so it can hold one run of the job and wait for another the
 * command holds. PostgreSQL would break that cycle only after deadlock_timeout (1 s by default)
 * and by cancelling either side: a START batch's calls a second late, or the command answered
 * 409. The command yields first instead, and the batch goes on (on a server whose deadlock_timeout
 * is shorter than this, the command may be the side PostgreSQL fails: it tries again the same
 * way). Locking by id inside those batches too would avoid the cycle at the price of a second
 * pass over every run they take (START: 19 → 45 µs of backend CPU per run,
 * `bench/claim-sql.ts --ahead`).
 */
const YIELD_AFTER_MS = 50;
/**
 * How long a command keeps trying before it gives up (then answered 409, nothing written): as long
 * as the pool lets one statement wait (its statement_timeout, store/db.ts), which is how long the
 * command waited for a held run before it yielded.
 */
const LOCK_PATIENCE_MS = 30_000;

/** lock_timeout expired (55P03, lock_not_available), or PostgreSQL chose this side of a deadlock. */
const isLockWaitGivenUp = (err: unknown) => {
  const code = (err as { code?: unknown } | null)?.code;
  return code === '55P03' || code === '40P01';
};

/**
 * Runs `lock` (statements that lock or write rows others may hold) inside the command's transaction,
 * yielding (see YIELD_AFTER_MS): each try runs under a savepoint with a short lock_timeout, and a
 * try that waited too long rolls back to it, which lets go of the rows it locked. Returns what the
 * try that went through returned; the transaction's own lock_timeout holds again afterwards.
 */
async function lockYielding<T>(db: DbClient, lock: () => Promise<T>): Promise<T> {
  const { rows } = await db.query<{ previous: string }>(`SELECT current_setting('lock_timeout') AS previous`);
  const giveUpAt = performance.now() + LOCK_PATIENCE_MS;
  // One savepoint for every try: a rollback to it keeps it (a new one per try would nest).
  await db.query('SAVEPOINT lock_yielding');
  for (;;) {
    // Set inside the savepoint, so the rollback to it undoes it too: set again for each try.
    await db.query(`SET LOCAL lock_timeout = ${YIELD_AFTER_MS}`);
    let result: T;
    try {
      result = await lock();
    } catch (err) {
      if (!isLockWaitGivenUp(err) || performance.now() > giveUpAt) throw err;
      await db.query('ROLLBACK TO SAVEPOINT lock_yielding');
      continue;
    }
    await db.query('RELEASE SAVEPOINT lock_yielding');
    await db.query(`SELECT set_config('lock_timeout', $1, true)`, [rows[0]!.previous]);
    return result;
  }
}

/**
 * Deletes job $1's scheduled runs that are due after this statement's start (its `boundary`) and
 * never started (started_at NULL: no call was made for them): created ahead of their time by the
 * dispatcher's lookahead, queued, claimed ahead by a worker (its call waits for startRuns, which
 * finds nothing to start once this commits), or handed back uncalled by a stopping worker. A retry
 * or a replay has started_at set. A pause or an edit withdraws them, so the occurrences follow the
 * job as it is when they fall due: created again from the new definition once it is enabled, or not
 * at all while it is paused. (Marking them `skipped` instead left tombstones that a resume's new runs
 * ran into: ON CONFLICT (job_id, scheduled_for) DO NOTHING lost them.) Their announcements may still
 * reach workers, whose claims then find nothing. A run a worker has started is not deleted: its
 * update commits first and this delete, having waited for the row, re-reads it and leaves it (or the
 * other way round: see START in runs.ts).
 *
 * The boundary is the delete's own clock, read once every run it may take is locked
 * (LOCK_FUTURE_RUNS first): a START committed while the command waited (for an earlier reading's
 * createDueRuns, or for a row another writer held) is for an occurrence due by then, so on the
 * near side of the line. Drawn before such a wait, the line would have a later occurrence started,
 * kept and called while an earlier one was withdrawn.
 */
const LOCK_FUTURE_RUNS = `
  SELECT id FROM runs
  WHERE job_id = $1 AND trigger = 'schedule' AND scheduled_for > statement_timestamp()
    AND state IN ('queued', 'running') AND started_at IS NULL
  ORDER BY id
  FOR UPDATE`;

/** Locks job $1's runs LOCK_FUTURE_RUNS takes, yielding to a worker's batch (lockYielding). */
async function lockFutureRuns(db: DbClient, jobId: string): Promise<void> {
  await lockYielding(db, async () => {
    await db.query(LOCK_FUTURE_RUNS, [jobId]);
  });
}

const WITHDRAW_FUTURE_RUNS = `
  WITH line AS (
    SELECT statement_timestamp() AS boundary
  ), withdrawn AS (
    DELETE FROM runs
    WHERE job_id = $1 AND trigger = 'schedule' AND scheduled_for > (SELECT boundary FROM line)
      AND state IN ('queued', 'running') AND started_at IS NULL
    RETURNING scheduled_for
  )
  SELECT (SELECT boundary FROM line) AS boundary, min(scheduled_for) AS earliest FROM withdrawn`;

/** Where a withdrawal drew its line, and the earliest occurrence it withdrew (null: none). */
export interface Withdrawal {
  readonly boundary: Date;
  readonly earliest: Date | null;
}

/** Call inside the command's transaction (the locks hold until it ends). */
export async function withdrawFutureRuns(db: DbClient, jobId: string): Promise<Withdrawal> {
  await lockFutureRuns(db, jobId);
  const { rows } = await db.query<Withdrawal>(WITHDRAW_FUTURE_RUNS, [jobId]);
  return rows[0]!;
}

/**
 * Gives job $1's runs of occurrences after this statement's start (the command's line, `boundary`)
 * whose call has not begun, as WITHDRAW_FUTURE_RUNS takes them, the job's new misfire policy $2 in
 * their copy (runs.misfire). The workers judge a run left unclaimed through an outage by that copy
 * (runs.ts misfiredAtClaim), and an occurrence falling due after the edit follows the job as it is
 * then: kept as it was, a `skip` job edited to `fire-all` dropped the runs made ahead for its next
 * seconds. An edit of the policy alone withdraws nothing (dispatch.ts COPIED_COLUMNS), hence the
 * copy is changed in place. The line is read once every run it may take is locked
 * (LOCK_FUTURE_RUNS first), as for a withdrawal: drawn before that wait, later occurrences fell
 * due meanwhile and a worker dropped them by the old copy, while an earlier one whose row was held
 * got the new copy and fired (test/integration/misfire-edit-line-vs-lock-wait.test.ts).
 */
const RECOPY_MISFIRE = `
  WITH line AS (
    SELECT statement_timestamp() AS boundary
  ), recopied AS (
    UPDATE runs SET misfire = $2
    WHERE job_id = $1 AND trigger = 'schedule' AND scheduled_for > (SELECT boundary FROM line)
      AND state IN ('queued', 'running') AND started_at IS NULL AND misfire IS DISTINCT FROM $2
  )
  SELECT boundary FROM line`;

/**
 * Call inside the command's transaction, the job locked; yields to a worker's batch (lockYielding).
 * Returns the line it drew.
 */
export async function recopyMisfire(db: DbClient, jobId: string, misfire: MisfirePolicy): Promise<Date> {
  await lockFutureRuns(db, jobId);
  const { rows } = await db.query<{ boundary: Date }>(RECOPY_MISFIRE, [jobId, misfire]);
  return rows[0]!.boundary;
}

/** True when runs created from `after` would differ from runs created from `before`. */
export function runSnapshotChanged(before: JobFields, after: Omit<JobFields, 'nextRunAt'>): boolean {
  return RUN_SNAPSHOT_FIELDS.some((field) => !isDeepStrictEqual(before[field], after[field]));
}
