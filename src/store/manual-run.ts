import type { Queryable } from './db.js';
import { FIRST_ATTEMPT_MESSAGE, JOB_SNAPSHOT_VALUES, RUN_SNAPSHOT_COLUMNS } from './dispatch.js';

/**
 * The instant a manual run asked for at `clock` is scheduled for: `clock`, or, when that falls in
 * the first millisecond of a second, a millisecond later. Occurrences are whole seconds: a manual
 * run there would take the occurrence's slot (one run per job and instant), and the occurrence
 * would get no run; within its millisecond it would carry the occurrence's
 * `X-Helios-Scheduled-For` (milliseconds). Shifted, not rounded. Two clocks can still meet here
 * (the same microsecond, or s + 0.4 ms and s + 1.4 ms): createManualRun steps the later trigger on.
 */
export function manualRunInstant(clock: string): string {
  return `(${clock} + CASE WHEN ${clock} < date_trunc('second', ${clock}) + interval '1 millisecond'
                      THEN interval '1 millisecond' ELSE interval '0' END)`;
}

/**
 * Inserts a queued run of job $1 at `instant` (an expression yielding a table with one `instant`
 * column, aliased `at`) with a snapshot of the job, and its outbox row on topic $2, in one
 * statement (so in one transaction), with the same message the dispatcher writes
 * (FIRST_ATTEMPT_MESSAGE). A run already at that instant makes the insert a no-op.
 */
function insertManualRun(instant: string): string {
  return `
  WITH created AS (
    INSERT INTO runs (job_id, scheduled_for, trigger, state, ${RUN_SNAPSHOT_COLUMNS}, not_before)
    SELECT j.id, at.instant, 'manual', 'queued', ${JOB_SNAPSHOT_VALUES}, at.instant
    FROM jobs j, ${instant} at WHERE j.id = $1
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING id, job_id, scheduled_for, not_before, timeout_ms, concurrency
  ), queued AS (
    INSERT INTO outbox (topic, key, payload)
    SELECT $2, job_id::text, ${FIRST_ATTEMPT_MESSAGE}
    FROM created
  )`;
}

/** A manual run of job $1 due now (manualRunInstant). */
const CREATE_MANUAL_RUN = `${insertManualRun(`(SELECT ${manualRunInstant('now()')} AS instant)`)}
  SELECT id FROM created`;

/**
 * After CREATE_MANUAL_RUN met another manual run at its instant: a manual run 1 µs after the
 * latest manual run of job $1 at or after that instant (runs this statement sees: committed, or
 * of this transaction), shifted again off a second's first millisecond. Manual runs are never in
 * the future, so this stays within microseconds of now. Also says whether the job exists: a
 * trigger that met a run of another trigger still uncommitted at the stepped instant tries again.
 */
const CREATE_MANUAL_RUN_AFTER_OTHERS = `${insertManualRun(`(
    SELECT ${manualRunInstant('stepped.instant')} AS instant FROM (
      SELECT GREATEST(asked.instant, (
        SELECT max(r.scheduled_for) + interval '1 microsecond' FROM runs r
        WHERE r.job_id = $1 AND r.trigger = 'manual' AND r.scheduled_for >= asked.instant)) AS instant
      FROM (SELECT ${manualRunInstant('now()')} AS instant) asked) stepped)`)}
  SELECT (SELECT id FROM created) AS id, EXISTS (SELECT 1 FROM jobs WHERE id = $1) AS "jobExists"`;

/** Statements a trigger tries before giving up while other triggers keep taking its instant. */
const MAX_TRIES = 5;

/** What a trigger's statements made: the new run's id, or why none was made (nothing written). */
export type ManualRun =
  | { readonly runId: string }
  /**
   * `no-job`: the job does not exist, or was deleted before the run could be written;
   * `contended`: MAX_TRIES statements each met a concurrent trigger at their instant.
   */
  | { readonly runId: null; readonly why: 'no-job' | 'contended' };

/**
 * Creates a manual run of job $1 due now (CREATE_MANUAL_RUN). Another manual run at the same
 * instant (a trigger in the same microsecond, or in the same transaction) does not swallow this
 * one: it is made just after (CREATE_MANUAL_RUN_AFTER_OTHERS), one more statement only then.
 */
export async function createManualRun(db: Queryable, jobId: string, topic: string): Promise<ManualRun> {
  try {
    const { rows } = await db.query<{ id: string }>(CREATE_MANUAL_RUN, [jobId, topic]);
    if (rows[0]) return { runId: rows[0].id };
    for (let tries = 1; tries < MAX_TRIES; tries += 1) {
      const { rows: after } = await db.query<{ id: string | null; jobExists: boolean }>(
        CREATE_MANUAL_RUN_AFTER_OTHERS,
        [jobId, topic],
      );
      if (after[0]!.id !== null) return { runId: after[0]!.id };
      if (!after[0]!.jobExists) return { runId: null, why: 'no-job' };
    }
    return { runId: null, why: 'contended' };
  } catch (err) {
    // The job was read from the statement's snapshot but deleted before the insert's foreign key
    // check could lock it (a DELETE committed meanwhile): the job does not exist, as above.
    if ((err as { code?: unknown } | null)?.code === '23503') return { runId: null, why: 'no-job' };
    throw err;
  }
}
