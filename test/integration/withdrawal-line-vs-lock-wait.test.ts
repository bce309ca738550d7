import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { patchJob, pauseJob } from '../../src/jobs/commands.js';
import { parseCron } from '../../src/scheduling/cron.js';
import type { JobRecord } from '../../src/store/jobs.js';
import { claimRuns, startRuns, type ClaimedRun, type ClaimOptions } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilWaitingForLocks } from '../support/execution.js';
import { dbNow, untilDbTime } from '../support/db-time.js';

// A pause or an edit draws its line (B) when it withdraws. Were B read before the delete waited for
// a row lock on one of the job's not-yet-started runs (any writer of such a run: a claim batch
// taking the next occurrence ahead, a stopping worker's release, a slow commit), a later occurrence
// Y (B < Y) could fall due meanwhile and its START commit before the delete reached Y's row; READ
// COMMITTED re-checks Y's new version, finds started_at set and keeps it: Y would be called though
// its occurrence is after the line, while an earlier one was withdrawn. withdrawFutureRuns locks
// the runs first and reads the line after (store/jobs.ts LOCK_FUTURE_RUNS).

let db: TestDatabase;
const NODE = 'node-a';
const COMMANDS = { runsTopic: 'runs', misfireThresholdMs: 5000 };
const ahead: ClaimOptions = { nodeId: NODE, graceMs: 5000, skewToleranceMs: 10, leadMs: 600_000 };

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

async function makeJob(): Promise<string> {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     VALUES ('lw-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/old"}', 1000, 3,
             'allow', now() + interval '1 hour') RETURNING id`,
  );
  return rows[0]!.id;
}

/** A queued run of `jobId` at `at` (SQL expression), as the dispatcher creates it. */
async function makeRun(jobId: string, at: string): Promise<{ id: string; scheduledFor: Date }> {
  const { rows } = await db.pool.query<{ id: string; scheduledFor: Date }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, t, 'queued', j.max_attempts, j.target, j.timeout_ms, 100, 2, j.concurrency, t
     FROM jobs j, (SELECT ${at} AS t) s WHERE j.id = $1
     RETURNING id, scheduled_for AS "scheduledFor"`,
    [jobId],
  );
  return rows[0]!;
}

const newTarget = (current: JobRecord) => ({
  fields: { ...current, target: { url: 'http://127.0.0.1:9/new', method: 'GET', headers: {} } },
  schedule: parseCron(current.schedule, current.timezone),
});

/**
 * X (the earlier occurrence, and earlier in the heap: first in any scan order) is being claimed
 * ahead by a transaction still in flight; Y (the next occurrence) is claimed ahead and waits for
 * its time. The command's DELETE starts (its line B < X < Y) and waits on X; Y falls due and is
 * STARTed; then X's writer commits and the DELETE goes on.
 */
async function raceCommandWithStart(command: (jobId: string) => Promise<JobRecord | null>) {
  const jobId = await makeJob();
  const x = await makeRun(jobId, "date_trunc('second', clock_timestamp()) + interval '2 seconds'");
  const y = await makeRun(jobId, "date_trunc('second', clock_timestamp()) + interval '3 seconds'");
  const [claimedY] = await claimRuns(db.pool, [{ runId: y.id, expectedAttempt: null }], ahead);
  assert.ok(claimedY?.startPending, 'Y claimed ahead, waiting for START');
  const writer = await db.pool.connect();
  try {
    await writer.query('BEGIN');
    const [claimedX] = await claimRuns(writer, [{ runId: x.id, expectedAttempt: null }], ahead);
    assert.ok(claimedX, 'X claim in flight (uncommitted)');
    const commanding = command(jobId);
    await untilWaitingForLocks(db.pool);
    // The command's statement waiting on X has begun: its statement_timestamp() is at most this.
    const lineAtMost = await dbNow(db.pool);
    assert.ok(x.scheduledFor.getTime() > lineAtMost, 'precondition: X and Y are after the line');
    await untilDbTime(db.pool, y.scheduledFor);
    const startedNow = await Promise.race([
      startRuns(db.pool, NODE, [claimedY as ClaimedRun]).then(([s]) => s!),
      // START blocked (by the DELETE) is a correct outcome: let X's writer go so it can finish.
      sleep(300).then(() => 'blocked' as const),
    ]);
    await writer.query('COMMIT');
    const result = await commanding;
    assert.ok(result);
    const exists = async (id: string, cond = 'true') =>
      (await db.pool.query(`SELECT 1 FROM runs WHERE id = $1 AND ${cond}`, [id])).rowCount === 1;
    const yStarted = startedNow === 'blocked' ? await exists(y.id, 'started_at IS NOT NULL') : startedNow;
    const xWithdrawn = !(await exists(x.id));
    const { rows } = await db.pool.query<{ url: string | null }>(
      `SELECT target->>'url' AS url FROM runs WHERE id = $1`,
      [y.id],
    );
    return { yStarted, xWithdrawn, lineAtMost, x, y, yUrl: rows[0]?.url ?? null, result };
  } finally {
    writer.release();
  }
}

const describe = (r: Awaited<ReturnType<typeof raceCommandWithStart>>) =>
  `line at most ${new Date(r.lineAtMost).toISOString()}; occurrence ${r.x.scheduledFor.toISOString()} ` +
  `${r.xWithdrawn ? 'withdrawn' : 'kept'}, later occurrence ${r.y.scheduledFor.toISOString()} ` +
  `${r.yStarted ? `STARTed and kept (target ${r.yUrl}): it is called` : 'not started'}; ` +
  `command answered nextRunAt ${r.result.nextRunAt?.toISOString()}`;

test('pause whose DELETE waits on a row lock: no later occurrence is called while an earlier one is withdrawn', async () => {
  const r = await raceCommandWithStart((jobId) => pauseJob(db.pool, { id: jobId }, COMMANDS));
  assert.ok(!(r.xWithdrawn && r.yStarted), describe(r));
});

test('edit (new target) whose DELETE waits on a row lock: no later occurrence runs the old definition while an earlier one is re-created from the new', async () => {
  const r = await raceCommandWithStart((jobId) => patchJob(db.pool, { id: jobId }, newTarget, COMMANDS));
  assert.ok(!(r.xWithdrawn && r.yStarted), describe(r));
});
