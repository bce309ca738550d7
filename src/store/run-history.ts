import type { Queryable } from './db.js';
import type { RunState, RunTrigger, StoredTarget } from '../model.js';

export interface RunSummary {
  readonly id: string;
  readonly jobId: string;
  readonly scheduledFor: Date;
  readonly trigger: RunTrigger;
  readonly state: RunState;
  readonly attempt: number;
  readonly maxAttempts: number;
  readonly notBefore: Date;
  readonly claimedBy: string | null;
  readonly reason: string | null;
  readonly lastStatus: number | null;
  readonly lastError: string | null;
  readonly createdAt: Date;
  readonly startedAt: Date | null;
  readonly finishedAt: Date | null;
  /** `scheduled_for` as PostgreSQL text (microseconds kept), for cursors. */
  readonly cursorTs: string;
}

export interface RunDetail extends RunSummary {
  readonly target: StoredTarget;
  readonly timeoutMs: number;
  readonly backoffMs: number;
  readonly backoffMultiplier: number;
  readonly claimExpiresAt: Date | null;
}

export interface AttemptRecord {
  readonly attempt: number;
  readonly nodeId: string;
  readonly startedAt: Date;
  readonly finishedAt: Date | null;
  readonly outcome: string | null;
  readonly statusCode: number | null;
  readonly durationMs: number | null;
  readonly error: string | null;
  readonly responseExcerpt: string | null;
}

const SUMMARY = `
  id, job_id AS "jobId", scheduled_for AS "scheduledFor", trigger, state, attempt,
  max_attempts AS "maxAttempts", not_before AS "notBefore", claimed_by AS "claimedBy", reason,
  last_status AS "lastStatus", last_error AS "lastError", created_at AS "createdAt",
  started_at AS "startedAt", finished_at AS "finishedAt", scheduled_for::text AS "cursorTs"`;

/**
 * Runs of job $1, newest occurrence first, before cursor $2 (scheduled_for text; NULL = from the
 * newest), optionally only in state $3. $4 = limit. A job has one run per occurrence
 * (runs_one_per_occurrence), so scheduled_for alone orders them and that index serves the scan.
 */
const LIST_OF_JOB = `
  SELECT ${SUMMARY} FROM runs
  WHERE job_id = $1
    AND ($2::timestamptz IS NULL OR scheduled_for < $2::timestamptz)
    AND ($3::text IS NULL OR state = $3)
  ORDER BY scheduled_for DESC
  LIMIT $4`;

export async function listRunsOfJob(
  db: Queryable,
  jobId: string,
  options: { before: { ts: string; id: string } | null; state: RunState | null; limit: number },
): Promise<RunSummary[]> {
  const { before, state, limit } = options;
  const { rows } = await db.query<RunSummary>(LIST_OF_JOB, [jobId, before?.ts ?? null, state, limit]);
  return rows;
}

/** One run with its snapshot. $1 = run id. */
const SELECT_RUN = `
  SELECT ${SUMMARY}, target, timeout_ms AS "timeoutMs", backoff_ms AS "backoffMs",
         backoff_multiplier AS "backoffMultiplier", claim_expires_at AS "claimExpiresAt"
  FROM runs WHERE id = $1`;

/** Attempts of run $1, first attempt first. */
const SELECT_ATTEMPTS = `
  SELECT attempt, node_id AS "nodeId", started_at AS "startedAt", finished_at AS "finishedAt",
         outcome, status_code AS "statusCode", duration_ms AS "durationMs", error,
         response_excerpt AS "responseExcerpt"
  FROM run_attempts WHERE run_id = $1 ORDER BY attempt`;

/** A run and its attempts; null when there is no such run. */
export async function findRun(
  db: Queryable,
  id: string,
): Promise<{ run: RunDetail; attempts: AttemptRecord[] } | null> {
  const { rows } = await db.query<RunDetail>(SELECT_RUN, [id]);
  const run = rows[0];
  if (!run) return null;
  const attempts = await db.query<AttemptRecord>(SELECT_ATTEMPTS, [id]);
  return { run, attempts: attempts.rows };
}
