import type { Queryable } from './db.js';
import { waitsForRunningSibling } from './runs.js';

/** The cluster's queues as the leader reads them for its gauges (see observability/cluster-signals.ts). */
export interface ClusterCounts {
  /** Outbox rows not yet published (due or put off), at most the cap. */
  readonly outboxPending: number;
  /** Seconds the oldest due, unpublished outbox row has waited; 0 when none is due. */
  readonly outboxOldestAgeSeconds: number;
  /** Runs queued (waiting for their time, a worker, or a retry's back-off), at most the cap. */
  readonly runsQueued: number;
  /**
   * Queued runs due longer ago than the overdue threshold, at most the cap; not a `forbid` job's
   * retry or replay waiting for the job's running run ({@link ClusterCounts.runsWaitingForbid}).
   */
  readonly runsOverdue: number;
  /**
   * Retries and replays of `forbid` jobs due and waiting for another run of their job to end (no
   * worker may claim them meanwhile: waitsForRunningSibling), at most the cap.
   */
  readonly runsWaitingForbid: number;
  /** Runs claimed by a worker and executing, at most the cap. */
  readonly runsRunning: number;
  /** Dead letters not replayed, at most the cap. */
  readonly deadLettersOpen: number;
}

/**
 * Every count in one statement, each over a partial index and stopped at $2 rows, so a backlog of
 * millions costs the same as one of $2: an alert needs "far too many", not the exact figure.
 * The outbox age reads only the first entry of the pending index (ordered by publish_after).
 * The runs waiting for a `forbid` sibling are found from the jobs running something (a few
 * hundred at most, one lookup of their active runs each), never from the queue, which may hold
 * millions (test/integration/runs-waiting-forbid.test.ts counts the rows the plan reads).
 * $1 = overdue threshold in ms, $2 = cap per count.
 */
const CLUSTER_COUNTS = `
  SELECT
    (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE published_at IS NULL LIMIT $2) o)::int
      AS "outboxPending",
    coalesce((SELECT greatest(0, extract(epoch FROM now() - publish_after))::float8
              FROM outbox WHERE published_at IS NULL AND publish_after <= now()
              ORDER BY publish_after, id LIMIT 1), 0) AS "outboxOldestAgeSeconds",
    (SELECT count(*) FROM (SELECT 1 FROM runs WHERE state = 'queued' LIMIT $2) q)::int AS "runsQueued",
    (SELECT count(*) FROM (SELECT 1 FROM runs r WHERE r.state = 'queued'
                             AND r.not_before < now() - $1 * interval '1 millisecond'
                             AND NOT ${waitsForRunningSibling('r')} LIMIT $2) d)::int
      AS "runsOverdue",
    -- A subquery per job running something: a join was planned as a hash join over all of runs.
    (SELECT least(coalesce(sum((
       SELECT count(*) FROM runs w
       WHERE w.job_id = busy.job_id AND w.state = 'queued' AND w.not_before <= now()
         AND ${waitsForRunningSibling('w')})), 0), $2)
     FROM (SELECT DISTINCT job_id FROM runs WHERE state = 'running') busy)::int AS "runsWaitingForbid",
    (SELECT count(*) FROM (SELECT 1 FROM runs WHERE state = 'running' LIMIT $2) r)::int AS "runsRunning",
    (SELECT count(*) FROM (SELECT 1 FROM dead_letters WHERE replayed_at IS NULL LIMIT $2) l)::int
      AS "deadLettersOpen"`;

/** Reads the cluster's queue counts, each capped at `cap` (see CLUSTER_COUNTS). */
export async function readClusterCounts(
  db: Queryable,
  overdueMs: number,
  cap: number,
): Promise<ClusterCounts> {
  const { rows } = await db.query<ClusterCounts>(CLUSTER_COUNTS, [overdueMs, cap]);
  return rows[0]!;
}
