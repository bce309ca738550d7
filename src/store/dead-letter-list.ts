import type { Queryable } from './db.js';

export interface DeadLetterRecord {
  readonly id: string;
  readonly runId: string;
  readonly jobId: string;
  readonly jobName: string;
  readonly attempt: number;
  readonly error: string | null;
  readonly statusCode: number | null;
  readonly createdAt: Date;
  readonly replayedAt: Date | null;
  readonly replayCount: number;
  /** `created_at` as PostgreSQL text (microseconds kept), for cursors. */
  readonly cursorTs: string;
}

/**
 * Dead letters, newest first, before cursor ($1 created_at text, $2 id; NULL = newest), with
 * $3 = true for only those not yet replayed (NULL = all). $4 = limit.
 */
const LIST = `
  SELECT d.id, d.run_id AS "runId", d.job_id AS "jobId", j.name AS "jobName", d.attempt, d.error,
         d.status_code AS "statusCode", d.created_at AS "createdAt", d.replayed_at AS "replayedAt",
         d.replay_count AS "replayCount", d.created_at::text AS "cursorTs"
  FROM dead_letters d JOIN jobs j ON j.id = d.job_id
  WHERE ($1::timestamptz IS NULL OR (d.created_at, d.id) < ($1::timestamptz, $2::uuid))
    AND ($3::boolean IS NULL OR (d.replayed_at IS NULL) = $3)
  ORDER BY d.created_at DESC, d.id DESC
  LIMIT $4`;

export async function listDeadLetters(
  db: Queryable,
  options: { before: { ts: string; id: string } | null; open: boolean | null; limit: number },
): Promise<DeadLetterRecord[]> {
  const { before, open, limit } = options;
  const { rows } = await db.query<DeadLetterRecord>(LIST, [
    before?.ts ?? null,
    before?.id ?? null,
    open,
    limit,
  ]);
  return rows;
}

/** Whether dead letter $1 exists and was replayed. */
const FIND = `SELECT replayed_at IS NOT NULL AS replayed FROM dead_letters WHERE id = $1`;

/** Null when there is no such dead letter. */
export async function deadLetterState(db: Queryable, id: string): Promise<{ replayed: boolean } | null> {
  const { rows } = await db.query<{ replayed: boolean }>(FIND, [id]);
  return rows[0] ?? null;
}
