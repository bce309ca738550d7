import type { Queryable } from './db.js';
import { FIRST_ATTEMPT_MESSAGE, JOB_SNAPSHOT_VALUES, RUN_SNAPSHOT_COLUMNS } from './dispatch.js';

/**
 * The instant a manual run asked for at `clock` is scheduled for: `clock`, or, when that falls in
 * the first millisecond of a second, a millisecond later. Occurrences are whole seconds: a manual
 * run there would take the occurrence's slot (one run per job and instant), and the occurrence
 * would get no run; within its millisecond it would carry the occurrence's
 * `X-Helios-Scheduled-For` (milliseconds). Shifted, not rounded: two triggers at different
 * microseconds stay two runs.
 */
export function manualRunInstant(clock: string): string {
  return `(${clock} + CASE WHEN ${clock} < date_trunc('second', ${clock}) + interval '1 millisecond'
                      THEN interval '1 millisecond' ELSE interval '0' END)`;
}

/**
 * Creates a queued run of job $1 due now (manualRunInstant) with a snapshot of the job, and its
 * outbox row on topic $2, in one statement (so in one transaction), with the same message the
 * dispatcher writes (FIRST_ATTEMPT_MESSAGE). Another manual run at the very same microsecond makes
 * the insert a no-op.
 */
const CREATE_MANUAL_RUN = `
  WITH created AS (
    INSERT INTO runs (job_id, scheduled_for, trigger, state, ${RUN_SNAPSHOT_COLUMNS}, not_before)
    SELECT j.id, at.instant, 'manual', 'queued', ${JOB_SNAPSHOT_VALUES}, at.instant
    FROM jobs j, (SELECT ${manualRunInstant('now()')} AS instant) at WHERE j.id = $1
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING id, job_id, scheduled_for, not_before, timeout_ms, concurrency
  ), queued AS (
    INSERT INTO outbox (topic, key, payload)
    SELECT $2, job_id::text, ${FIRST_ATTEMPT_MESSAGE}
    FROM created
  )
  SELECT id FROM created`;

/** The new run's id; null when the job does not exist or a run for this instant already exists. */
export async function createManualRun(db: Queryable, jobId: string, topic: string): Promise<string | null> {
  try {
    const { rows } = await db.query<{ id: string }>(CREATE_MANUAL_RUN, [jobId, topic]);
    return rows[0]?.id ?? null;
  } catch (err) {
    // The job was read from the statement's snapshot but deleted before the insert's foreign key
    // check could lock it (a DELETE committed meanwhile): the job does not exist, as above.
    if ((err as { code?: unknown } | null)?.code === '23503') return null;
    throw err;
  }
}
