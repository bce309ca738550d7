import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { serverEnv } from '../support/env.js';
import { EtcdServer } from '../support/etcd-server.js';
import { nextWholeSecond, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';

// A run whose leader still leads is only ever delayed, never dropped, however late (README,
// Misfires). A worker learns from etcd which epochs have ended (EndedEpochs); a worker pointed at
// another etcd, or at another HELIOS_ETCD_PREFIX, reads "no leader, revision R" there, with tokens
// unrelated to the leader's: its reading must not count (the fence names the cluster and key its
// token is of). Before that check, both such workers dropped the live leader's late runs as
// misfires (found by a review, helper-55).

const THRESHOLD_MS = 2000;
const settings = {
  HELIOS_DISPATCH_LOOKAHEAD_MS: '3000',
  HELIOS_MISFIRE_THRESHOLD_MS: String(THRESHOLD_MS),
};
let fx: IntegrationFixture;

const mainEtcdUrl = serverEnv().etcdEndpoints.split(',')[0]!;
/** The leader's etcd: one of the test's own, on these ports. */
const leaderEtcdPort = Number(new URL(mainEtcdUrl).port) + 50;
let leaderEtcd: EtcdServer | undefined;

before(async () => {
  fx = await integrationFixture();
});
after(async () => {
  await fx.teardown();
  await leaderEtcd?.stop();
});

/** A `skip` job firing every second from the next whole second; returns its id and first due time. */
async function everySecondSkipJob(name: string): Promise<{ id: string; first: Date }> {
  const first = await nextWholeSecond(fx.db.pool, 500);
  const { rows } = await fx.db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, misfire, timeout_ms, next_run_at)
     VALUES ($1, '* * * * * *', $2, 'skip', 5000, $3) RETURNING id`,
    [name, { url: `${fx.target.url}/${name}`, method: 'POST' }, first],
  );
  return { id: rows[0]!.id, first };
}

interface Row {
  scheduledFor: Date;
  state: string;
  reason: string | null;
  createdEpoch: string;
}

/**
 * No worker for 5 s while the leader dispatches a every-second `skip` job (its runs pile up, the
 * first ones late by more than the threshold), then one worker starts with `workerEnv`. Returns the
 * runs that were already late when the worker started, once settled.
 */
async function lateRunsAfterWorker(job: string, workerName: string, workerEnv: Record<string, string>) {
  const { id, first } = await everySecondSkipJob(job);
  await sleep(first.getTime() + 5000 - Date.now());
  const workerStart = new Date();
  const worker = await fx.start(
    workerName,
    { ...settings, HELIOS_ROLES: 'worker,api', ...workerEnv },
    {
      worker: true,
    },
  );
  const lateBefore = new Date(workerStart.getTime() - THRESHOLD_MS - 500);
  await waitFor(
    'the late runs settled',
    async () =>
      (
        await fx.db.pool.query(
          `SELECT 1 FROM runs WHERE job_id = $1 AND scheduled_for < $2 AND state IN ('queued', 'running')`,
          [id, lateBefore],
        )
      ).rowCount === 0,
    20_000,
    100,
  );
  const { rows } = await fx.db.pool.query<Row>(
    `SELECT scheduled_for AS "scheduledFor", state, reason, created_epoch::text AS "createdEpoch"
     FROM runs WHERE job_id = $1 AND scheduled_for < $2 ORDER BY scheduled_for`,
    [id, lateBefore],
  );
  await fx.db.pool.query('UPDATE jobs SET enabled = false WHERE id = $1', [id]);
  worker.node.signal('SIGTERM');
  await worker.node.exited;
  return rows;
}

test(
  "a worker pointed at another etcd or prefix does not drop the live leader's late runs",
  { timeout: 150_000 },
  async () => {
    leaderEtcd = await EtcdServer.start('leader', leaderEtcdPort);
    const leaderEtcdUrl = leaderEtcd.url;
    const leaderEtcdClient = createEtcdClient([leaderEtcdUrl]);
    for (let i = 0; i < 50; i++) await leaderEtcdClient.put(`/bump`).value(String(i));

    // The leader, on an etcd of its own (fresh: its token is far below the shared etcd's revision).
    const leader = await fx.start(
      'other-leader',
      { ...settings, HELIOS_ROLES: 'scheduler,api', HELIOS_ETCD_ENDPOINTS: leaderEtcdUrl },
      { leader: true },
    );
    const token = (await leaderEtcdClient.get(`${fx.etcdPrefix}/leader`).exec()).kvs[0]!.create_revision;

    // Control: a worker on the leader's etcd and prefix. Late runs of the live leader: delayed only.
    const control = await lateRunsAfterWorker('right-etcd', 'worker-right', {
      HELIOS_ETCD_ENDPOINTS: leaderEtcdUrl,
    });

    // A worker whose HELIOS_ETCD_PREFIX differs (a typo), same etcd as the leader.
    const typo = await lateRunsAfterWorker('prefix-typo', 'worker-typo', {
      HELIOS_ETCD_ENDPOINTS: leaderEtcdUrl,
      HELIOS_ETCD_PREFIX: `${fx.etcdPrefix}-typo`,
    });

    // A worker pointed at another etcd (the shared one: its revision is far above the leader's token).
    const wrong = await lateRunsAfterWorker('wrong-etcd', 'worker-wrong', {
      HELIOS_ETCD_ENDPOINTS: mainEtcdUrl,
    });

    // The leader led throughout, with the same key and token.
    assert.ok(!leader.node.logs.some((l) => l.msg === 'stepped down'), 'the leader never stepped down');
    const now = (await leaderEtcdClient.get(`${fx.etcdPrefix}/leader`).exec()).kvs[0]!.create_revision;
    assert.equal(now, token, 'same leader key throughout');
    leaderEtcdClient.close();

    assert.ok(control.length >= 2 && control.every((r) => r.state === 'succeeded'), 'control: delayed, run');
    assert.deepEqual(
      {
        typo: typo.filter((r) => r.reason === 'misfire').length,
        wrong: wrong.filter((r) => r.reason === 'misfire').length,
      },
      { typo: 0, wrong: 0 },
      "a live leader's runs are delayed, never dropped",
    );
  },
);
