import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { inTransaction } from '../../src/store/db.js';
import { buryRun, replayDeadLetter } from '../../src/store/dead-letters.js';
import { JOB_SNAPSHOT_VALUES, RUN_SNAPSHOT_COLUMNS } from '../../src/store/dispatch.js';
import { createManualRun } from '../../src/store/manual-run.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { uniqueId } from '../support/env.js';
import { attemptsOf, insertJob, nextWholeSecond, runsOf, stopJobs, waitFor } from '../support/execution.js';

let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture({
    behaviour: (request) => (request.path === '/slow' ? { status: 200, delayMs: 2500 } : { hang: true }),
  });
  // Two workers, so the runs of one job really are claimed by different processes.
  for (const [name, roles] of [
    ['conc-1', 'scheduler,worker'],
    ['conc-2', 'worker'],
  ] as const) {
    fx.spawn(name, { HELIOS_ROLES: roles });
  }
  await fx.nodes[0]!.waitForLog((l) => l.msg === 'became leader', 30_000);
  await Promise.all(fx.nodes.map((n) => n.waitForLog((l) => l.msg === 'joined consumer group', 30_000)));
});
after(() => fx.teardown());

/** An every-second job that runs for `seconds` and is then disabled. */
async function everySecond(path: string, concurrency: 'forbid' | 'replace', seconds: number) {
  const start = await nextWholeSecond(fx.db.pool, 1500);
  const jobId = await insertJob(fx.db.pool, {
    name: `${concurrency}-${uniqueId()}`,
    schedule: '* * * * * *',
    target: { url: `${fx.target.url}${path}` },
    nextRunAt: start,
    concurrency,
    timeoutMs: 5000,
    maxAttempts: 1,
  });
  await sleep(start.getTime() - Date.now() + seconds * 1000 - 500);
  await stopJobs(fx.db.pool, [jobId]);
  return jobId;
}

test(
  'forbid: no two runs of the job ever run at once; the overlapping occurrences are skipped',
  { timeout: 40_000 },
  async () => {
    // Every second, but each call takes 2.5 s.
    const jobId = await everySecond('/slow', 'forbid', 8);
    await sleep(3500); // let the last call finish
    const calls = fx.target.forJob(jobId).sort((a, b) => a.arrivedAt - b.arrivedAt);
    assert.ok(calls.length >= 2, `calls: ${calls.length}`);
    for (let i = 1; i < calls.length; i++) {
      assert.ok(
        calls[i]!.arrivedAt >= calls[i - 1]!.endedAt!,
        `call ${i} started ${(calls[i - 1]!.endedAt! - calls[i]!.arrivedAt).toFixed(0)} ms before call ${i - 1} ended`,
      );
    }
    const runs = await runsOf(fx.db.pool, jobId);
    const skipped = runs.filter((r) => r.state === 'skipped');
    assert.ok(skipped.length >= 3, `skipped: ${skipped.length} of ${runs.length}`);
    assert.ok(skipped.every((r) => r.reason === 'concurrency-forbid'));
    assert.equal(runs.filter((r) => r.state === 'succeeded').length, calls.length);
    assert.deepEqual(
      runs.filter((r) => !['succeeded', 'skipped'].includes(r.state)),
      [],
    );
  },
);

test(
  'replace: a new run cancels the running one (its call is aborted, it is recorded failed/replaced)',
  { timeout: 40_000 },
  async () => {
    // Every second, and the target never answers: each run is still running when the next is due.
    const jobId = await everySecond('/never', 'replace', 4);
    await sleep(300);
    const runs = await runsOf(fx.db.pool, jobId);
    const calls = fx.target.forJob(jobId).sort((a, b) => a.arrivedAt - b.arrivedAt);
    assert.ok(calls.length >= 3, `calls: ${calls.length}`);
    const replaced = runs.filter((r) => r.state === 'failed' && r.reason === 'replaced');
    assert.ok(replaced.length >= calls.length - 1, JSON.stringify(runs.map((r) => [r.state, r.reason])));
    for (const run of replaced) assert.equal((await attemptsOf(fx.db.pool, run.id))[0]?.outcome, 'replaced');
    // Each call but the newest was aborted by its worker right after the next run started.
    for (let i = 0; i < calls.length - 1; i++) {
      assert.ok(calls[i]!.aborted, `call ${i} was not aborted`);
      const lag = calls[i]!.endedAt! - calls[i + 1]!.arrivedAt;
      assert.ok(
        lag > -50 && lag < 500,
        `call ${i} was aborted ${lag.toFixed(0)} ms after the next call started`,
      );
    }
    const running = runs.filter((r) => r.state === 'running');
    assert.ok(running.length <= 1, 'at most the newest run is still running');
  },
);

test(
  'replace: a replay is asked for now, so it replaces the running newer occurrence and is called',
  { timeout: 40_000 },
  async () => {
    // A yearly job (nothing of its schedule falls in the test) whose calls hang.
    const jobId = await insertJob(fx.db.pool, {
      name: `replace-replay-${uniqueId()}`,
      schedule: '0 0 0 1 1 *',
      target: { url: `${fx.target.url}/never` },
      nextRunAt: new Date(Date.now() + 200 * 86_400_000),
      concurrency: 'replace',
      timeoutMs: 20_000,
      maxAttempts: 1,
    });
    // An occurrence of a minute ago that went dead, dead-lettered as the worker does it.
    const letterId = await inTransaction(fx.db.pool, async (client) => {
      const { rows } = await client.query<{ id: string; scheduledFor: Date }>(
        `INSERT INTO runs (job_id, scheduled_for, state, attempt, ${RUN_SNAPSHOT_COLUMNS}, not_before, finished_at)
         SELECT j.id, now() - interval '1 minute', 'dead', 1, ${JOB_SNAPSHOT_VALUES}, now() - interval '1 minute', now()
         FROM jobs j WHERE j.id = $1
         RETURNING id, scheduled_for AS "scheduledFor"`,
        [jobId],
      );
      const dead = rows[0]!;
      return buryRun(
        client,
        { id: dead.id, jobId, attempt: 1, scheduledFor: dead.scheduledFor },
        { error: 'HTTP 503', statusCode: 503 },
        { deadLetterTopic: `${fx.topic}.dlq` },
      );
    });
    // A newer run (a trigger: due now, after the dead occurrence) is running, its call open.
    const manualId = (await createManualRun(fx.db.pool, jobId, fx.topic)).runId!;
    await waitFor('the manual run is called', () =>
      fx.target.forJob(jobId).some((c) => c.runId === manualId),
    );

    const replay = (await replayDeadLetter(fx.db.pool, letterId, { runsTopic: fx.topic }))!;
    const call = await waitFor('the replayed run is called', () =>
      fx.target.forJob(jobId).find((c) => c.runId === replay.runId && c.attempt === replay.attempt),
    );
    // The manual run, asked for before the replay, is the one replaced: its call aborted.
    const manual = await waitFor('the manual run replaced', async () =>
      (await runsOf(fx.db.pool, jobId)).find((r) => r.id === manualId && r.state === 'failed'),
    );
    assert.equal(manual.reason, 'replaced');
    await waitFor('the manual run call aborted', () =>
      fx.target.forJob(jobId).find((c) => c.runId === manualId && c.aborted),
    );
    const replayed = (await runsOf(fx.db.pool, jobId)).find((r) => r.id === replay.runId)!;
    assert.equal(replayed.state, 'running', `the replayed run ended ${replayed.state} (${replayed.reason})`);
    assert.ok(!call.aborted, 'the replayed call was aborted');
  },
);
