import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { nextWholeSecond, oncePerMinuteAt, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';

// The whole cluster (one node) is killed with a run made ahead, in time, still queued; after its
// occurrence is due by more than the misfire threshold a worker comes back first, with no leader
// at all: no new epoch has written the fence, but etcd says the run's leader is gone (its key
// expired), so the job's `skip` policy drops the run instead of it running late. (The fence alone
// would let it run: misfire-outage.test.ts starts a leader first.)

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

test(
  'a worker back before any leader drops a late run of the ended epoch as its skip policy says',
  { timeout: 90_000 },
  async () => {
    const first = await fx.start('worker-first-1', settings, { leader: true, worker: true });
    const due = await nextWholeSecond(fx.db.pool, 4000);
    const { rows } = await fx.db.pool.query<{ id: string }>(
      `INSERT INTO jobs (name, schedule, target, misfire, timeout_ms, next_run_at)
       VALUES ('skip-minutely', $1, $2, 'skip', 5000, $3) RETURNING id`,
      [oncePerMinuteAt(due), { url: `${fx.target.url}/skip`, method: 'POST' }, due],
    );
    const skip = rows[0]!.id;
    await waitFor(
      'the run created ahead',
      async () =>
        (await fx.db.pool.query('SELECT 1 FROM runs WHERE job_id = $1 AND scheduled_for = $2', [skip, due]))
          .rowCount === 1,
      10_000,
      50,
    );
    await sleep(Math.max(0, due.getTime() - 1500 - Date.now()));
    first.node.signal('SIGKILL');
    await first.node.exited;
    assert.ok(Date.now() < due.getTime() - 1000, 'killed before the run was claimed');
    const { rows: fence } = await fx.db.pool.query<{ ended: boolean }>(
      `SELECT f.token > r.created_epoch AS ended FROM leader_fence f, runs r
       WHERE f.id AND r.job_id = $1 AND r.scheduled_for = $2`,
      [skip, due],
    );
    assert.deepEqual(fence, [{ ended: false }], "the fence still holds the run's epoch");

    // Back after the threshold (and the dead leader's 3 s lease): a worker only, no scheduler.
    await sleep(due.getTime() + THRESHOLD_MS + 1500 - Date.now());
    await fx.start('worker-first-2', { ...settings, HELIOS_ROLES: 'worker,api' }, { worker: true });
    await waitFor(
      'the run settled',
      async () =>
        (
          await fx.db.pool.query(
            "SELECT 1 FROM runs WHERE job_id = $1 AND scheduled_for = $2 AND state <> 'queued'",
            [skip, due],
          )
        ).rowCount === 1,
      15_000,
      100,
    );
    const { rows: runs } = await fx.db.pool.query<{ state: string; reason: string | null }>(
      'SELECT state, reason FROM runs WHERE job_id = $1 AND scheduled_for = $2',
      [skip, due],
    );
    assert.deepEqual(runs, [{ state: 'skipped', reason: 'misfire' }]);
    assert.deepEqual(fx.target.forJob(skip), [], 'the skip job was not called');
  },
);
