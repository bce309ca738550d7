import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { patchJob } from '../../src/jobs/commands.js';
import type { MisfirePolicy } from '../../src/model.js';
import { parseCron } from '../../src/scheduling/cron.js';
import { inTransaction } from '../../src/store/db.js';
import { advanceJobs, createRuns } from '../../src/store/dispatch.js';
import type { JobRecord } from '../../src/store/jobs.js';
import { claimRuns } from '../../src/store/runs.js';
import { dbNow, untilDbTime } from '../support/db-time.js';
import { nextWholeSecond, oncePerMinuteAt, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { untilNewEpochWrote } from '../support/late-runs.js';
import { apiCall } from '../support/node-api.js';

// An edit of `misfire` alone withdraws nothing (the runs made ahead keep waiting for their time
// while no leader could make them again), but the workers judge a run made ahead by its own copy
// of the policy (runs.misfire, misfiredAtClaim). An occurrence falling due after the edit must
// follow the policy in force then: a run made ahead for it, left unclaimed through an outage
// (its leader's epoch ended), is dropped or fired as the edited job says, not as the job was
// when the run was made. One due before the edit keeps the old policy. First on the store's
// commands and claims, then end to end: a node killed with the run queued, started again late.

let fx: IntegrationFixture;
const THRESHOLD_MS = 1000;
const COMMANDS = { runsTopic: 'runs', misfireThresholdMs: THRESHOLD_MS };
/** The epoch of the leader that made the runs ahead; a newer one has written the fence since. */
const OLD_EPOCH = 1n;

before(async () => {
  fx = await integrationFixture();
});
after(() => fx.teardown());

async function makeJob(misfire: MisfirePolicy): Promise<string> {
  const { rows } = await fx.db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, misfire, next_run_at)
     VALUES ('me-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3, 'allow',
             $1, now()) RETURNING id`,
    [misfire],
  );
  return rows[0]!.id;
}

/** What the old leader did: runs made ahead (in time) for these occurrences, next_run_at after them. */
async function madeAhead(jobId: string, occurrences: number[]): Promise<void> {
  await inTransaction(fx.db.pool, async (client) => {
    const at = occurrences.map((t) => ({ jobId, scheduledFor: new Date(t) }));
    await createRuns(client, at, OLD_EPOCH, 'runs');
    await advanceJobs(client, [{ id: jobId, nextRunAt: new Date(occurrences.at(-1)! + 1000) }]);
  });
}

const editMisfire = (misfire: MisfirePolicy) => (current: JobRecord) => ({
  fields: { ...current, misfire },
  schedule: parseCron(current.schedule, current.timezone),
});

/** Which of the job's runs a worker's claim takes now, by occurrence (the rest it leaves as misfires). */
async function claimable(jobId: string): Promise<Map<number, boolean>> {
  const { rows } = await fx.db.pool.query<{ id: string; at: Date }>(
    'SELECT id, scheduled_for AS at FROM runs WHERE job_id = $1 ORDER BY scheduled_for',
    [jobId],
  );
  const claimed = await claimRuns(
    fx.db.pool,
    rows.map((r) => ({ runId: r.id, expectedAttempt: null })),
    { nodeId: 'w', graceMs: 3000, skewToleranceMs: 10, misfireThresholdMs: THRESHOLD_MS },
  );
  return new Map(rows.map((r, i) => [r.at.getTime(), claimed[i] !== null]));
}

test('an edit of misfire alone applies to the runs made ahead for occurrences after its line, not to those before', async () => {
  const now = await dbNow(fx.db.pool);
  const dueBefore = Math.floor(now / 1000) * 1000 - 1000;
  const first = Math.ceil(now / 1000) * 1000 + 1000;
  const ahead = [first, first + 1000, first + 2000];
  const toFireAll = await makeJob('skip');
  const toSkip = await makeJob('fire-all');
  const onceToAll = await makeJob('fire-once');
  for (const job of [toFireAll, toSkip, onceToAll]) await madeAhead(job, [dueBefore, ...ahead]);

  // The edits answer before the first run made ahead is due.
  assert.ok(await patchJob(fx.db.pool, { id: toFireAll }, editMisfire('fire-all'), COMMANDS));
  assert.ok(await patchJob(fx.db.pool, { id: toSkip }, editMisfire('skip'), COMMANDS));
  assert.ok(await patchJob(fx.db.pool, { id: onceToAll }, editMisfire('fire-all'), COMMANDS));
  assert.ok((await dbNow(fx.db.pool)) < first, 'the edits answered before the occurrences made ahead');

  // The cluster goes down: a newer epoch writes the fence, and no worker claims a run until every
  // one is later than the threshold.
  await fx.db.pool.query('UPDATE leader_fence SET token = $1', [(OLD_EPOCH + 1n).toString()]);
  await untilDbTime(fx.db.pool, ahead.at(-1)! + THRESHOLD_MS + 200);

  const fireAll = await claimable(toFireAll);
  assert.equal(fireAll.get(dueBefore), false, 'due before the edit, while the job was `skip`: dropped');
  for (const t of ahead)
    assert.equal(fireAll.get(t), true, `${new Date(t).toISOString()} fell due while the job was fire-all`);
  const skip = await claimable(toSkip);
  assert.equal(skip.get(dueBefore), true, 'due before the edit, while the job was fire-all: fired');
  for (const t of ahead)
    assert.equal(skip.get(t), false, `${new Date(t).toISOString()} fell due while the job was \`skip\``);
  // fire-once dropped every late run but the latest; fire-all, in force when these fell due, none.
  const all = await claimable(onceToAll);
  assert.equal(
    all.get(dueBefore),
    false,
    'due before the edit, while fire-once, later ones late too: dropped',
  );
  for (const t of ahead)
    assert.equal(all.get(t), true, `${new Date(t).toISOString()} fell due while the job was fire-all`);
  await fx.db.pool.query('DELETE FROM jobs');
});

test(
  'a `skip` job edited to fire-all after its run was made ahead, the cluster down through the occurrence: called once, late',
  { timeout: 90_000 },
  async () => {
    const settings = {
      HELIOS_DISPATCH_LOOKAHEAD_MS: '3000',
      HELIOS_MISFIRE_THRESHOLD_MS: String(THRESHOLD_MS),
    };
    const first = await fx.start('edit-1', settings, { leader: true, worker: true });
    const due = await nextWholeSecond(fx.db.pool, 4000);
    // Made through the API, so that the edit below changes nothing runs copy (nothing withdrawn).
    const job = await apiCall<{ id: string }>(first.apiUrl, 'POST', '/jobs', {
      name: 'edited-minutely',
      schedule: oncePerMinuteAt(due),
      misfire: 'skip',
      timeoutMs: 5000,
      target: { url: `${fx.target.url}/edited`, method: 'POST' },
    });
    const runAtDue = async () =>
      (
        await fx.db.pool.query<{ state: string; reason: string | null; misfire: string }>(
          'SELECT state, reason, misfire FROM runs WHERE job_id = $1 AND scheduled_for = $2',
          [job.id, due],
        )
      ).rows;
    await waitFor('the run made ahead', async () => (await runAtDue()).length === 1, 10_000, 50);
    await apiCall(first.apiUrl, 'PATCH', `/jobs/${job.id}`, { misfire: 'fire-all' });
    await sleep(Math.max(0, due.getTime() - 1500 - Date.now()));
    first.node.signal('SIGKILL');
    await first.node.exited;
    assert.ok(Date.now() < due.getTime() - 1000, 'killed before the run was claimed');

    // Back well past the threshold: a leader first (its epoch writes the fence), then a worker.
    await sleep(due.getTime() + THRESHOLD_MS + 1500 - Date.now());
    const leader = await fx.start('edit-2', { ...settings, HELIOS_ROLES: 'scheduler,api' }, { leader: true });
    await leader.node.waitForLog((l) => l.msg === 'became leader', 30_000);
    await untilNewEpochWrote(fx, job.id);
    await fx.start('edit-3', { ...settings, HELIOS_ROLES: 'worker,api' }, { worker: true });
    await waitFor(
      'the run at due settled',
      async () => ['succeeded', 'skipped'].includes((await runAtDue())[0]?.state ?? ''),
      10_000,
      50,
    );
    assert.deepEqual(await runAtDue(), [{ state: 'succeeded', reason: null, misfire: 'fire-all' }]);
    const calls = fx.target.requests.filter((r) => r.jobId === job.id);
    assert.deepEqual(
      calls.map((r) => Date.parse(r.scheduledFor)),
      [due.getTime()],
      'fell due while the job was fire-all: called once',
    );
  },
);
