import type pg from 'pg';
import { isUuid } from '../model.js';
import type { Queryable } from './db.js';
import { inTransaction } from './db.js';
import { enqueueAttempt, type RequeuedRun } from './runs.js';
import { RECOPY_JOB } from './dispatch.js';

/** Records a dead run. $1 = run id, $2 = job id, $3 = last attempt, $4 = error, $5 = status. */
const INSERT_DEAD_LETTER = `
  INSERT INTO dead_letters (run_id, job_id, attempt, error, status_code)
  VALUES ($1, $2, $3, $4, $5)
  RETURNING id, created_at AS "createdAt"`;

/** The dead-letter topic message. $1 = topic, $2 = key (job id), $3 = payload. */
const ANNOUNCE_DEAD = `INSERT INTO outbox (topic, key, payload) VALUES ($1, $2, $3)`;

/** The message published on the dead-letter topic (JSON). */
export interface DeadLetterMessage {
  readonly deadLetterId: string;
  readonly runId: string;
  readonly jobId: string;
  readonly attempt: number;
  readonly scheduledFor: string;
  readonly error: string | null;
  readonly statusCode: number | null;
  readonly deadAt: string;
}

/**
 * Writes the dead_letters row and its dead-letter topic outbox row, in the caller's transaction
 * (the one that set the run `dead`). Returns the dead letter's id.
 */
export async function buryRun(
  client: pg.PoolClient,
  run: { id: string; jobId: string; attempt: number; scheduledFor: Date },
  last: { error: string | null; statusCode: number | null },
  topics: { deadLetterTopic: string },
): Promise<string> {
  const { rows } = await client.query<{ id: string; createdAt: Date }>(INSERT_DEAD_LETTER, [
    run.id,
    run.jobId,
    run.attempt,
    last.error,
    last.statusCode,
  ]);
  const letter = rows[0]!;
  const message: DeadLetterMessage = {
    deadLetterId: letter.id,
    runId: run.id,
    jobId: run.jobId,
    attempt: run.attempt,
    scheduledFor: run.scheduledFor.toISOString(),
    error: last.error,
    statusCode: last.statusCode,
    deadAt: letter.createdAt.toISOString(),
  };
  await client.query(ANNOUNCE_DEAD, [topics.deadLetterTopic, run.jobId, message]);
  return letter.id;
}

/**
 * Locks the job of dead letter $1 first. A DELETE of the job locks the job, then (cascading) its
 * runs, then their dead letters; a replay that locked the dead letter and then the run took them
 * in the opposite order and the two could deadlock. Taking the job first serialises them: a replay
 * after the delete finds nothing to replay.
 */
const LOCK_JOB_OF_LETTER = `
  SELECT 1 FROM jobs WHERE id = (SELECT job_id FROM dead_letters WHERE id = $1) FOR KEY SHARE`;

/** Marks an open dead letter replayed. $1 = dead letter id. */
const MARK_REPLAYED = `
  UPDATE dead_letters SET replayed_at = now(), replay_count = replay_count + 1
  WHERE id = $1 AND replayed_at IS NULL
  RETURNING run_id AS "runId"`;

/**
 * Re-queues a dead run as a new attempt due now, with a fresh budget of the job's current
 * max_attempts (attempt numbers keep counting up, so the budget is attempt + max_attempts),
 * and its forgiven claim expiries start again from zero: an operator who replays a run that died
 * in a crash loop gets the same protection from a lost claim acknowledgement as a new run.
 * The run takes a fresh copy of its job as it is now (target, timeout, back-off, concurrency,
 * misfire: RECOPY_JOB), as the runbook has it: fix the job, then replay. Its copy from
 * when it was created was the definition that failed; a masked header goes with the job's URL it
 * was stored for. Returns a RequeuedRun (REQUEUED_RUN_COLUMNS, qualified here: jobs has
 * timeout_ms and concurrency too). $1 = run id.
 */
const REQUEUE_DEAD = `
  UPDATE runs r SET state = 'queued', not_before = now(), finished_at = NULL, reason = 'replayed',
                    max_attempts = r.attempt + j.max_attempts, expiries = 0, ${RECOPY_JOB}
  FROM jobs j
  WHERE r.id = $1 AND r.state = 'dead' AND j.id = r.job_id
  RETURNING r.id, r.job_id AS "jobId", r.attempt, r.scheduled_for AS "scheduledFor",
            r.not_before AS "notBefore", r.timeout_ms AS "timeoutMs", r.concurrency`;

/** What a replay did. */
export interface ReplayResult {
  readonly runId: string;
  readonly jobId: string;
  /** The attempt number the replayed run will start as. */
  readonly attempt: number;
}

/** Thrown inside the replay transaction to roll it back. */
class NothingToReplay extends Error {}

/**
 * Replays a dead letter: the run goes back to `queued` as a new attempt with a fresh attempt
 * budget, the dead letter gets `replayed_at`, and an outbox row announces the attempt on
 * `options.runsTopic`, all in one transaction. Returns null when the dead letter is unknown or
 * was already replayed (or its run is no longer dead). Used by `POST /dead-letters/{id}/replay`.
 */
export async function replayDeadLetter(
  pool: pg.Pool,
  deadLetterId: string,
  options: { runsTopic: string },
): Promise<ReplayResult | null> {
  if (!isUuid(deadLetterId)) return null;
  return inTransaction(pool, async (client) => {
    await client.query(LOCK_JOB_OF_LETTER, [deadLetterId]);
    const marked = await client.query<{ runId: string }>(MARK_REPLAYED, [deadLetterId]);
    const runId = marked.rows[0]?.runId;
    if (!runId) return null;
    const requeued = await client.query<RequeuedRun>(REQUEUE_DEAD, [runId]);
    const run = requeued.rows[0];
    // Marked but not re-queued: roll back so the dead letter stays open.
    if (!run) throw new NothingToReplay();
    const announced = await enqueueAttempt(client, run, options.runsTopic);
    return { runId: run.id, jobId: run.jobId, attempt: announced.attempt };
  }).catch((err: unknown) => {
    if (err instanceof NothingToReplay) return null;
    throw err;
  });
}

/** Dead letters not yet replayed (for dashboards and tests). */
export async function countOpenDeadLetters(db: Queryable): Promise<number> {
  const { rows } = await db.query<{ n: number }>(
    'SELECT count(*)::int AS n FROM dead_letters WHERE replayed_at IS NULL',
  );
  return rows[0]?.n ?? 0;
}
