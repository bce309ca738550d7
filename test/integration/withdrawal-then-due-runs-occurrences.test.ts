import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { patchJob, pauseJob, resumeJob } from '../../src/jobs/commands.js';
import { parseCron } from '../../src/scheduling/cron.js';
import { planOccurrences } from '../../src/scheduling/occurrences.js';
import { inTransaction } from '../../src/store/db.js';
import { advanceJobs, createRuns, selectDueJobs } from '../../src/store/dispatch.js';
import type { JobRecord } from '../../src/store/jobs.js';
import { claimRuns, startRuns } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { dbNow } from '../support/db-time.js';

// pauseJob / patchJob withdraw first (the line is drawn by the withdrawal),
// then create what fell due up to that line (createDueRuns), then set next_run_at. Checked here
// with the dispatcher's own steps afterwards (selectDueJobs, planOccurrences, createRuns,
// advanceJobs): every occurrence has exactly one run, those due before the command follow the
// old definition and those after it the new one; nothing withdrawn is left without a run once the
// dispatcher has caught up (next_run_at never skips past a withdrawn occurrence); a pause leaves
// nothing after its line.

let db: TestDatabase;
const COMMANDS = { runsTopic: 'runs', misfireThresholdMs: 5000 };
const LOOKAHEAD_MS = 3000;

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** One dispatcher pass (without the fence), as Dispatcher.dispatchBatch does it. */
async function dispatchOnce(): Promise<void> {
  await inTransaction(db.pool, async (client) => {
    const { now, jobs } = await selectDueJobs(client, LOOKAHEAD_MS, 100, COMMANDS.misfireThresholdMs);
    const horizon = new Date(now.getTime() + LOOKAHEAD_MS);
    const occurrences: { jobId: string; scheduledFor: Date }[] = [];
    const advances: { id: string; nextRunAt: Date | null }[] = [];
    for (const job of jobs) {
      const plan = planOccurrences(
        parseCron(job.schedule, job.timezone),
        job,
        now,
        horizon,
        COMMANDS.misfireThresholdMs,
      );
      for (const at of plan.fire) occurrences.push({ jobId: job.id, scheduledFor: at });
      advances.push({ id: job.id, nextRunAt: plan.nextRunAt });
    }
    await createRuns(client, occurrences, null, 'runs');
    await advanceJobs(client, advances);
  });
}

async function makeJob(nextRunAtSql: string): Promise<string> {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     VALUES ('wd-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/old"}', 1000, 3, 'allow',
             ${nextRunAtSql}) RETURNING id`,
  );
  return rows[0]!.id;
}

async function runsOf(jobId: string) {
  const { rows } = await db.pool.query<{ id: string; at: Date; url: string; startedAt: Date | null }>(
    `SELECT id, scheduled_for AS at, target->>'url' AS url, started_at AS "startedAt"
     FROM runs WHERE job_id = $1 ORDER BY scheduled_for`,
    [jobId],
  );
  return rows;
}

const newTarget = (current: JobRecord) => ({
  fields: { ...current, target: { url: 'http://127.0.0.1:9/new', method: 'GET', headers: {} } },
  schedule: parseCron(current.schedule, current.timezone),
});

/** Whole seconds in [from, to]. */
function seconds(from: number, to: number): number[] {
  const out: number[] = [];
  for (let t = Math.ceil(from / 1000) * 1000; t <= to; t += 1000) out.push(t);
  return out;
}

for (const lagging of [false, true]) {
  test(`edit (new target) of an enabled job, dispatcher ${lagging ? 'lagging 3 s' : 'ahead by its lookahead, runs claimed ahead'}: one run per occurrence, old before the edit, new after, none skipped`, async () => {
    const firstAt = Math.floor((await dbNow(db.pool)) / 1000) * 1000 - (lagging ? 3000 : -1000);
    const jobId = await makeJob(`to_timestamp(${firstAt / 1000})`);
    if (!lagging) {
      await dispatchOnce();
      // Claim every run ahead; START the one due first once it is due (kept by the edit if due).
      const ids = (await runsOf(jobId)).map((r) => ({ runId: r.id, expectedAttempt: null }));
      await claimRuns(db.pool, ids, { nodeId: 'n', graceMs: 5000, skewToleranceMs: 10, leadMs: 600_000 });
    }
    const before = await dbNow(db.pool);
    const edited = await patchJob(db.pool, { id: jobId }, newTarget, COMMANDS);
    const afterEdit = await dbNow(db.pool);
    assert.ok(edited);
    // The withdrawn occurrences are asked for again: next_run_at is not past any occurrence without a run.
    const have = new Set((await runsOf(jobId)).map((r) => r.at.getTime()));
    for (const t of seconds(firstAt, edited.nextRunAt!.getTime() - 1)) {
      assert.ok(have.has(t), `occurrence ${new Date(t).toISOString()} is before next_run_at and has no run`);
    }
    await dispatchOnce();
    const horizon = (await dbNow(db.pool)) + LOOKAHEAD_MS - 50;
    const runs = await runsOf(jobId);
    const byAt = new Map(runs.map((r) => [r.at.getTime(), r]));
    assert.equal(byAt.size, runs.length, 'one run per occurrence');
    for (const t of seconds(firstAt, horizon)) {
      const run = byAt.get(t);
      assert.ok(run, `occurrence ${new Date(t).toISOString()} has no run`);
      if (t <= before)
        assert.equal(run.url, 'http://127.0.0.1:9/old', `${run.at.toISOString()} due before the edit`);
      if (t > afterEdit && run.startedAt === null) {
        assert.equal(run.url, 'http://127.0.0.1:9/new', `${run.at.toISOString()} after the edit`);
      }
    }
  });
}

test('pause with a lagging dispatcher: what fell due is created, nothing after the line; resume starts after now', async () => {
  const firstAt = Math.floor((await dbNow(db.pool)) / 1000) * 1000 - 3000;
  const jobId = await makeJob(`to_timestamp(${firstAt / 1000})`);
  const before = await dbNow(db.pool);
  const paused = await pauseJob(db.pool, { id: jobId }, COMMANDS);
  const afterPause = await dbNow(db.pool);
  assert.equal(paused?.enabled, false);
  const runs = await runsOf(jobId);
  const ats = runs.map((r) => r.at.getTime());
  for (const t of seconds(firstAt, before))
    assert.ok(ats.includes(t), `due ${new Date(t).toISOString()} not created`);
  assert.ok(
    ats.every((t) => t <= afterPause),
    'a run after the pause line was created',
  );
  assert.ok(paused!.nextRunAt!.getTime() > Math.max(...ats), 'next_run_at after the created runs');
  await dispatchOnce();
  assert.equal((await runsOf(jobId)).length, runs.length, 'the dispatcher creates nothing for a paused job');
  const resumed = await resumeJob(db.pool, { id: jobId });
  assert.ok(resumed!.nextRunAt!.getTime() > afterPause);
});

test('pause after a claimed-ahead run was STARTed at its time: kept (due before the line); the next, unstarted, withdrawn', async () => {
  const firstAt = Math.floor((await dbNow(db.pool)) / 1000) * 1000 + 1000;
  const jobId = await makeJob(`to_timestamp(${firstAt / 1000})`);
  await dispatchOnce();
  const runs = await runsOf(jobId);
  const claimed = await claimRuns(
    db.pool,
    runs.map((r) => ({ runId: r.id, expectedAttempt: null })),
    { nodeId: 'n', graceMs: 5000, skewToleranceMs: 10, leadMs: 600_000 },
  );
  const first = claimed.find((c) => c?.scheduledFor.getTime() === firstAt)!;
  while ((await dbNow(db.pool)) < firstAt) await new Promise((r) => setTimeout(r, 20));
  assert.deepEqual(await startRuns(db.pool, 'n', [first]), [true]);
  await pauseJob(db.pool, { id: jobId }, COMMANDS);
  const left = await runsOf(jobId);
  assert.deepEqual(
    left.map((r) => r.id),
    [first.id],
  );
  const rest = claimed.filter((c) => c && c.id !== first.id);
  assert.deepEqual(
    await startRuns(
      db.pool,
      'n',
      rest.map((c) => c!),
    ),
    rest.map(() => false),
  );
});
