import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { patchJob } from '../../src/jobs/commands.js';
import { parseCron } from '../../src/scheduling/cron.js';
import { inTransaction } from '../../src/store/db.js';
import { advanceJobs, createRuns } from '../../src/store/dispatch.js';
import type { JobRecord } from '../../src/store/jobs.js';
import { claimRuns, skipMisfiredRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { dbNow, untilDbTime } from '../support/db-time.js';
import { untilWaitingForLocks } from '../support/execution.js';

// An edit of `misfire` alone gives the runs made ahead for occurrences after its line the new
// policy in place (jobs.ts recopyMisfire). Were the line read before the update waited for a row
// lock on one of those runs (any writer of it: a claim batch waiting on another row, a stopping
// worker's release, a slow commit), later occurrences could fall due meanwhile, past the misfire
// threshold, and a worker judge them by the old copy, while an earlier one, its row held, got the
// new copy once let go: the earlier occurrence fired under the edited policy and the later one was
// dropped under the old, which no instant of the edit explains (contract item 10). recopyMisfire
// locks the runs first and reads the line after, as withdrawFutureRuns does.

let db: TestDatabase;
const THRESHOLD_MS = 1000;
const COMMANDS = { runsTopic: 'runs', misfireThresholdMs: THRESHOLD_MS };
/** The epoch of the leader that made the runs ahead; a newer one has written the fence since. */
const OLD_EPOCH = 1n;
const claiming = { nodeId: 'w', graceMs: 3000, skewToleranceMs: 10, misfireThresholdMs: THRESHOLD_MS };

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

const toFireAll = (current: JobRecord) => ({
  fields: { ...current, misfire: 'fire-all' as const },
  schedule: parseCron(current.schedule, current.timezone),
});

/** Whether a worker's claim takes the run now. */
const claimable = async (runId: string) =>
  (await claimRuns(db.pool, [{ runId, expectedAttempt: null }], claiming))[0] !== null;

test('an edit of misfire whose update waits on a row lock: no later occurrence is dropped by the old policy while an earlier one fires by the new', async () => {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, misfire, next_run_at)
     VALUES ('ml-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3, 'allow',
             'skip', now()) RETURNING id`,
  );
  const jobId = rows[0]!.id;
  const now = await dbNow(db.pool);
  const early = Math.ceil(now / 1000) * 1000 + 1000;
  const late = early + 1000;
  // Far enough ahead to stay after the edit's line however long it waited.
  const afterEdit = late + 3000;
  await inTransaction(db.pool, async (client) => {
    const at = [early, late, afterEdit].map((t) => ({ jobId, scheduledFor: new Date(t) }));
    await createRuns(client, at, OLD_EPOCH, 'runs');
    await advanceJobs(client, [{ id: jobId, nextRunAt: new Date(afterEdit + 1000) }]);
  });
  const runs = await db.pool.query<{ id: string; at: Date }>(
    'SELECT id, scheduled_for AS at FROM runs WHERE job_id = $1',
    [jobId],
  );
  const runAt = (t: number) => runs.rows.find((r) => r.at.getTime() === t)!.id;
  // The leader that made them is gone: a newer epoch has written the fence.
  await db.pool.query('UPDATE leader_fence SET token = $1', [(OLD_EPOCH + 1n).toString()]);

  const writer = await db.pool.connect();
  try {
    await writer.query('BEGIN');
    await writer.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE', [runAt(early)]);
    const editing = patchJob(db.pool, { id: jobId }, toFireAll, COMMANDS);
    await untilWaitingForLocks(db.pool, { fragment: "trigger = 'schedule'" });
    assert.ok((await dbNow(db.pool)) < early, 'precondition: the edit began before either occurrence');

    // The later occurrence falls due while the edit waits, and its run goes unclaimed past the
    // threshold: a worker's claim finds it a misfire by the copy it holds, and skips it.
    await untilDbTime(db.pool, late + THRESHOLD_MS + 200);
    const lateClaimed = await claimable(runAt(late));
    const lateSkipped = !lateClaimed && (await skipMisfiredRun(db.pool, runAt(late), THRESHOLD_MS));
    await writer.query('ROLLBACK');
    assert.ok(await editing);

    await untilDbTime(db.pool, afterEdit + THRESHOLD_MS + 200);
    const earlyClaimed = await claimable(runAt(early));
    assert.ok(
      !(lateSkipped && earlyClaimed),
      `${new Date(late).toISOString()} was dropped as the job was before the edit (skip), yet the ` +
        `earlier ${new Date(early).toISOString()} fired as it is after (fire-all)`,
    );
    assert.equal(lateClaimed || lateSkipped, true, 'the later occurrence was judged while the edit waited');
    assert.equal(await claimable(runAt(afterEdit)), true, 'an occurrence after the edit follows fire-all');
  } finally {
    writer.release();
  }
});
