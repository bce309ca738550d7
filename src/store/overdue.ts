import type pg from 'pg';
import {
  claimRun,
  claimRuns,
  isForbidViolation,
  skipRun,
  type ClaimedRun,
  type ClaimOptions,
} from './runs.js';

// The polling fallback's SQL: runs whose announcement is late or lost are found here.

/**
 * Queued runs overdue by more than $1 ms (their message is late or lost), oldest first, locked
 * with SKIP LOCKED so concurrent pollers take disjoint sets. $2 = limit. A retry or replay of a
 * `forbid` job whose sibling is running waits for it (it cannot be skipped): leaving it out keeps
 * it from filling every poll while it waits.
 */
const SELECT_OVERDUE = `
  SELECT r.id FROM runs r
  WHERE r.state = 'queued' AND r.not_before <= now() - $1 * interval '1 millisecond'
    AND NOT (r.concurrency = 'forbid' AND r.attempt > 0 AND EXISTS (
      SELECT 1 FROM runs o WHERE o.job_id = r.job_id AND o.state = 'running'))
  ORDER BY r.not_before
  LIMIT $2
  FOR UPDATE OF r SKIP LOCKED`;

/**
 * Claims up to `limit` overdue runs in one transaction (a caller-supplied client inside BEGIN).
 * A fresh occurrence that its `forbid` policy blocks is skipped, like on the Kafka path; a blocked
 * retry stays queued for a later poll.
 */
export async function claimOverdueRuns(
  client: pg.PoolClient,
  overdueMs: number,
  limit: number,
  options: ClaimOptions,
): Promise<{ claimed: ClaimedRun[]; skipped: number }> {
  const { rows } = await client.query<{ id: string }>(SELECT_OVERDUE, [overdueMs, limit]);
  if (rows.length === 0) return { claimed: [], skipped: 0 };
  // The rows are locked by us, so a miss can only be a `forbid` block, and a forbid violation
  // (two runs of one forbid job in the batch) is the only likely error: then go one by one.
  await client.query('SAVEPOINT batch');
  let results: (ClaimedRun | null)[] | undefined;
  try {
    results = await claimRuns(
      client,
      rows.map((r) => ({ runId: r.id, expectedAttempt: null })),
      options,
    );
    await client.query('RELEASE SAVEPOINT batch');
  } catch (err) {
    if (!isForbidViolation(err)) throw err;
    await client.query('ROLLBACK TO SAVEPOINT batch');
  }
  const claimed: ClaimedRun[] = [];
  let skipped = 0;
  for (const [index, { id }] of rows.entries()) {
    const run = results ? results[index] : await claimOneInSavepoint(client, id, options);
    if (run) claimed.push(run);
    else if (await skipRun(client, id, 'concurrency-forbid')) skipped += 1;
  }
  return { claimed, skipped };
}

/** Claims one run; a forbid violation rolls back to a savepoint and returns null. */
async function claimOneInSavepoint(
  client: pg.PoolClient,
  runId: string,
  options: ClaimOptions,
): Promise<ClaimedRun | null> {
  await client.query('SAVEPOINT claim');
  try {
    const run = await claimRun(client, runId, options, null);
    await client.query('RELEASE SAVEPOINT claim');
    return run;
  } catch (err) {
    if (!isForbidViolation(err)) throw err;
    await client.query('ROLLBACK TO SAVEPOINT claim');
    return null;
  }
}
