import type pg from 'pg';
import {
  claimRun,
  claimRuns,
  endedEpochsParams,
  forbidBlocked,
  isForbidViolation,
  misfiredAtClaim,
  skipMisfiredRun,
  skipMisfiredRuns,
  skipRun,
  type ClaimedRun,
  type ClaimOptions,
  waitsForRunningSibling,
} from './runs.js';

// The polling fallback's SQL: runs whose announcement is late or lost are found here.

/**
 * Queued runs overdue by more than $1 ms (their message is late or lost), oldest first, locked
 * with SKIP LOCKED so concurrent pollers take disjoint sets. $2 = limit. A retry or replay of a
 * `forbid` job whose sibling is running waits for it (it cannot be skipped): leaving it out keeps
 * it from filling every poll while it waits. `blocked`: a `forbid` run that another run of its job
 * (running, or queued for a retry: forbidBlocked) keeps from starting now. `misfired`: see
 * misfiredAtClaim ($3 = the misfire threshold ms, NULL for none; $4 and $5 = etcd's reading of
 * ended epochs, NULL: none).
 */
const SELECT_OVERDUE = `
  SELECT r.id, r.job_id AS "jobId", r.concurrency,
         ${forbidBlocked('r')} AS blocked,
         ${misfiredAtClaim('r', '$3', { below: '$4', leaderKey: '$5' })} AS misfired
  FROM runs r
  WHERE r.state = 'queued' AND r.not_before <= now() - $1 * interval '1 millisecond'
    AND NOT ${waitsForRunningSibling('r')}
  ORDER BY r.not_before
  LIMIT $2
  FOR UPDATE OF r SKIP LOCKED`;

/**
 * Claims up to `limit` overdue runs in one transaction (a caller-supplied client inside BEGIN).
 * A fresh occurrence that its `forbid` policy blocks is skipped, like on the Kafka path; a blocked
 * retry stays queued for a later poll. A misfire its job's policy drops is skipped (`misfired`).
 *
 * The transaction must stay short: its claims' deadlines and its skips' times count from its
 * start (now()), and runs of a `forbid` job that start meanwhile elsewhere decide its skips. So
 * the one statement that claims holds at most one run of each `forbid` job and none that is
 * blocked: two of one job, or one whose sibling runs, fail the whole statement on
 * runs_forbid_one_running_idx, and claiming a full poll one by one after that took seconds
 * under load (chaos seed 6: 63 runs in 4.4 s after a PostgreSQL restart, every claim handed back
 * as too late; the oldest of three overdue occurrences skipped because a newer one started first).
 * The runs held back are tried one by one after it; there are only a few.
 */
export async function claimOverdueRuns(
  client: pg.PoolClient,
  overdueMs: number,
  limit: number,
  options: ClaimOptions,
): Promise<{ claimed: ClaimedRun[]; skipped: number; misfired: number }> {
  const threshold = options.misfireThresholdMs ?? null;
  // Read once: the select, the skips and the claim judge misfires alike.
  const ended = options.endedEpochs?.() ?? null;
  options = { ...options, endedEpochs: () => ended };
  const { rows } = await client.query<OverdueRow>(SELECT_OVERDUE, [
    overdueMs,
    limit,
    threshold,
    ...endedEpochsParams(ended),
  ]);
  if (rows.length === 0) return { claimed: [], skipped: 0, misfired: 0 };
  const batch: OverdueRow[] = [];
  const heldBack: OverdueRow[] = [];
  const forbidJobs = new Set<string>();
  // Locked by us: the skip judges the same rows again and finds them so. In one statement: after
  // an outage a poll may find hundreds, inside this transaction.
  const misfires = threshold === null ? [] : rows.filter((row) => row.misfired).map((row) => row.id);
  let misfired = threshold === null ? 0 : await skipMisfiredRuns(client, misfires, threshold, ended);
  for (const row of rows) {
    if (row.misfired && threshold !== null) continue;
    const forbid = row.concurrency === 'forbid';
    if (forbid && (row.blocked || forbidJobs.has(row.jobId))) heldBack.push(row);
    else batch.push(row);
    if (forbid) forbidJobs.add(row.jobId);
  }
  // The rows are locked by us, so a miss can only be a `forbid` block or a misfire, and a forbid
  // violation (a run of a forbid job started elsewhere since our SELECT) is the only likely error:
  // then go one by one.
  await client.query('SAVEPOINT batch');
  let results: (ClaimedRun | null)[] | undefined;
  try {
    results = await claimRuns(
      client,
      batch.map((r) => ({ runId: r.id, expectedAttempt: null })),
      options,
    );
    await client.query('RELEASE SAVEPOINT batch');
  } catch (err) {
    if (!isForbidViolation(err)) throw err;
    await client.query('ROLLBACK TO SAVEPOINT batch');
  }
  const claimed: ClaimedRun[] = [];
  let skipped = 0;
  // A locked row the claim left: a misfire (it may have crossed the threshold since the select),
  // else a `forbid` run its sibling blocks.
  const settle = async (row: OverdueRow, run: ClaimedRun | null) => {
    if (run) claimed.push(run);
    else if (threshold !== null && (await skipMisfiredRun(client, row.id, threshold, ended))) misfired += 1;
    else if (row.concurrency === 'forbid' && (await skipRun(client, row.id, 'concurrency-forbid')))
      skipped += 1;
  };
  for (const [index, row] of batch.entries()) {
    await settle(row, results ? results[index]! : await claimOneInSavepoint(client, row.id, options));
  }
  for (const row of heldBack) await settle(row, await claimOneInSavepoint(client, row.id, options));
  return { claimed, skipped, misfired };
}

interface OverdueRow {
  id: string;
  jobId: string;
  concurrency: string;
  blocked: boolean;
  misfired: boolean;
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
