import type { Queryable } from './db.js';

// Pruning history: finished runs (their attempts and dead letters cascade) and published outbox
// rows. Each statement deletes a bounded batch and locks only the rows it deletes, so pruning
// never holds long locks next to the dispatcher, the workers or the relay.

/**
 * Deletes finished runs of up to $4 jobs (ids after $3, in id order; NULL = from the start) that
 * are older than the cutoff $1 and not among their job's newest $2 runs, at most $5 per job. A
 * dead run whose dead letter is still open is kept: the operator has not dealt with it. Uses the
 * (job_id, scheduled_for) unique index per job, so no extra index on `runs` is needed.
 * Returns how many runs went, whether a job came back full ($5 runs: it may have more), and the
 * next cursor, the last job all of whose runs past the retention were tried: the last of the batch
 * when none came back full (NULL when the batch was empty), else the last before the first full
 * one ($3 when that one was first), so the next batch starts again at the full job.
 */
const PRUNE_RUNS = `
  WITH batch AS (
    SELECT id FROM jobs WHERE $3::uuid IS NULL OR id > $3::uuid ORDER BY id LIMIT $4
  ), bounds AS (
    SELECT b.id AS job_id, least($1::timestamptz, coalesce((
      SELECT k.scheduled_for FROM runs k WHERE k.job_id = b.id
      ORDER BY k.scheduled_for DESC OFFSET $2 LIMIT 1), '-infinity')) AS upto
    FROM batch b
  ), doomed AS (
    SELECT r.id FROM bounds
    CROSS JOIN LATERAL (
      SELECT r.id FROM runs r
      WHERE r.job_id = bounds.job_id AND r.scheduled_for <= bounds.upto
        AND r.state IN ('succeeded', 'failed', 'dead', 'skipped') AND r.finished_at < $1
        AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.run_id = r.id AND d.replayed_at IS NULL)
      ORDER BY r.scheduled_for
      LIMIT $5
      FOR UPDATE OF r SKIP LOCKED
    ) r
  ), deleted AS (
    -- The ids as an array (see PRUNE_OUTBOX): with statistics that counted almost no runs, the
    -- planner joined "id IN (SELECT id FROM doomed)" by scanning every run and the CTE again for each.
    DELETE FROM runs WHERE id = ANY (ARRAY(SELECT id FROM doomed)) RETURNING job_id
  ), full_job AS (
    -- Counted as deleted, not as doomed: a job whose deletes a trigger skips is not tried for ever.
    SELECT job_id FROM deleted GROUP BY job_id HAVING count(*) >= $5 ORDER BY job_id LIMIT 1
  )
  SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM full_job) THEN (SELECT max(id::text) FROM batch)
              ELSE coalesce((SELECT max(b.id::text) FROM batch b WHERE b.id < (SELECT job_id FROM full_job)),
                            $3::uuid::text) END AS "lastJob",
         EXISTS (SELECT 1 FROM full_job) AS full,
         (SELECT count(*)::int FROM deleted) AS pruned`;

export async function pruneRuns(
  db: Queryable,
  options: { cutoff: Date; keepPerJob: number; afterJob: string | null; jobs: number; perJob: number },
): Promise<{ lastJob: string | null; full: boolean; pruned: number }> {
  const { rows } = await db.query<{ lastJob: string | null; full: boolean; pruned: number }>(PRUNE_RUNS, [
    options.cutoff,
    options.keepPerJob,
    options.afterJob,
    options.jobs,
    options.perJob,
  ]);
  return rows[0]!;
}

/** The first job after `afterJob` in id order (from the start when null); null when none is. */
export async function nextJobAfter(db: Queryable, afterJob: string | null): Promise<string | null> {
  const { rows } = await db.query<{ id: string }>(
    'SELECT id FROM jobs WHERE $1::uuid IS NULL OR id > $1::uuid ORDER BY id LIMIT 1',
    [afterJob],
  );
  return rows[0]?.id ?? null;
}

/**
 * Deletes at most $2 outbox rows published more than $1 ms ago (outbox_published_idx), by primary
 * key. The ids go in an array, which the subquery fills once whatever the plan around it: as
 * "id IN (subquery)", with statistics taken when the outbox had been drained (a few live rows in
 * many pages, the outbox's usual life between herds) the planner chose a nested loop that ran the
 * subquery again for every row of the table (5,000 rows: 4 s; 20,000: past the 30 s statement
 * timeout), and with fresh statistics it scanned the whole table for each batch.
 */
const PRUNE_OUTBOX = `
  DELETE FROM outbox WHERE id = ANY (ARRAY(
    SELECT id FROM outbox WHERE published_at < now() - $1 * interval '1 millisecond'
    ORDER BY published_at LIMIT $2))`;

export async function pruneOutbox(db: Queryable, olderThanMs: number, limit: number): Promise<number> {
  const { rowCount } = await db.query(PRUNE_OUTBOX, [olderThanMs, limit]);
  return rowCount ?? 0;
}

/** The database's now() minus $1 ms: the retention cutoff by the one clock. */
export async function databaseCutoff(db: Queryable, retentionMs: number): Promise<Date> {
  const { rows } = await db.query<{ at: Date }>(`SELECT now() - $1 * interval '1 millisecond' AS at`, [
    retentionMs,
  ]);
  return rows[0]!.at;
}
