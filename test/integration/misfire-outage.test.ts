import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { nextWholeSecond, oncePerMinuteAt, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { untilNewEpochWrote } from '../support/late-runs.js';

// The whole cluster (one node) is killed after the dispatcher created runs ahead, in time, and
// started again after their occurrences were due by more than the misfire threshold: the jobs'
// misfire policies hold for those runs too, not only for the occurrences the dispatcher finds late.

const THRESHOLD_MS = 2000;
let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture();
});
after(() => fx.teardown());

const settings = {
  HELIOS_DISPATCH_LOOKAHEAD_MS: '3000',
  HELIOS_MISFIRE_THRESHOLD_MS: String(THRESHOLD_MS),
};

async function insertJob(name: string, schedule: string, misfire: string, nextRunAt: Date): Promise<string> {
  const { rows } = await fx.db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, misfire, max_catch_up, timeout_ms, next_run_at)
     VALUES ($1, $2, $3, $4, 2, 5000, $5) RETURNING id`,
    [name, schedule, { url: `${fx.target.url}/${name}`, method: 'POST' }, misfire, nextRunAt],
  );
  return rows[0]!.id;
}

test(
  'after the whole cluster was down, runs created ahead and claimed by no one in time follow their misfire policy',
  { timeout: 90_000 },
  async () => {
    const first = await fx.start('outage-1', settings, { leader: true, worker: true });
    const due = await nextWholeSecond(fx.db.pool, 4000);
    const soon = await nextWholeSecond(fx.db.pool, 0);
    const skip = await insertJob('skip-minutely', oncePerMinuteAt(due), 'skip', due);
    const once = await insertJob('once-every-second', '* * * * * *', 'fire-once', soon);
    const all = await insertJob('all-every-second', '* * * * * *', 'fire-all', soon);

    // The skip job's run exists (created up to the lookahead ahead) and is not claimed yet (the
    // claim lead is 750 ms): the node dies with it queued.
    await waitFor(
      'the skip job’s run created ahead',
      async () =>
        (await fx.db.pool.query('SELECT 1 FROM runs WHERE job_id = $1 AND scheduled_for = $2', [skip, due]))
          .rowCount === 1,
      10_000,
      50,
    );
    await sleep(Math.max(0, due.getTime() - 1500 - Date.now()));
    first.node.signal('SIGKILL');
    await first.node.exited;
    const killedAt = Date.now();
    assert.ok(killedAt < due.getTime() - 1000, 'killed before the skip job’s run was claimed');

    // Down until its runs are well past the threshold, then back: a leader first (its epoch writes
    // the fence: the runs' epoch has ended), then a worker. A worker back before the new leader's
    // first write would still run them late: the runs' leader might only be slow (README, Misfires).
    await sleep(due.getTime() + THRESHOLD_MS + 1500 - Date.now());
    const leader = await fx.start(
      'outage-2',
      { ...settings, HELIOS_ROLES: 'scheduler,api' },
      { leader: true },
    );
    await leader.node.waitForLog((l) => l.msg === 'became leader', 30_000);
    await untilNewEpochWrote(fx, skip);
    await fx.start('outage-3', { ...settings, HELIOS_ROLES: 'worker,api' }, { worker: true });
    await sleep(6000);

    const { rows: skipRuns } = await fx.db.pool.query<{ state: string; reason: string | null }>(
      'SELECT state, reason FROM runs WHERE job_id = $1 AND scheduled_for = $2',
      [skip, due],
    );
    assert.deepEqual(skipRuns, [{ state: 'skipped', reason: 'misfire' }], 'the skip job’s late run');
    assert.deepEqual(
      fx.target.requests.filter((r) => r.jobId === skip).map((r) => r.scheduledFor),
      [],
      'the skip job was not called',
    );

    // Runs the first node made and never claimed (no attempt of outage-1), or the new leader's
    // catch-up: called more than the threshold late, fire-once allows one (the latest missed
    // occurrence); fire-all drops none. (Runs the new leader made in time wait for the worker
    // that comes after it: delayed, not dropped, its epoch still leading.)
    const { rows: unclaimed } = await fx.db.pool.query<{
      id: string;
      jobId: string;
      state: string;
      reason: string;
    }>(
      `SELECT r.id, r.job_id AS "jobId", r.state, r.reason FROM runs r
       WHERE r.job_id = ANY($1) AND (r.created_at < $2 OR r.created_at > r.scheduled_for + $3 * interval '1 millisecond')
         AND NOT EXISTS (SELECT 1 FROM run_attempts a WHERE a.run_id = r.id AND a.node_id = 'outage-1')`,
      [[once, all], new Date(killedAt), THRESHOLD_MS],
    );
    const ids = new Set(unclaimed.map((r) => r.id));
    const lateCalls = (job: string) =>
      fx.target.requests.filter(
        (r) =>
          r.jobId === job &&
          ids.has(r.runId) &&
          r.arrivedAt - Date.parse(r.scheduledFor) > THRESHOLD_MS + 300,
      );
    const onceLate = lateCalls(once);
    assert.ok(
      onceLate.length <= 1,
      `fire-once made ${onceLate.length} calls more than the threshold late: ${onceLate.map((r) => r.scheduledFor).join(', ')}`,
    );
    assert.ok(
      unclaimed.some((r) => r.jobId === once && r.reason === 'misfire'),
      'fire-once skipped the older runs created ahead (else this test did not make an outage)',
    );
    assert.deepEqual(
      unclaimed.filter((r) => r.jobId === all && r.state === 'skipped'),
      [],
      'fire-all skipped none',
    );
    assert.ok(lateCalls(all).length >= 2, 'fire-all called its runs created ahead, late');
  },
);
