import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { serverEnv } from '../support/env.js';
import { EtcdServer } from '../support/etcd-server.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { lateRunsAfterWorker } from '../support/late-runs.js';

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

/** The runs already late when a worker with `workerEnv` started (see lateRunsAfterWorker). */
const lateRuns = (job: string, workerName: string, workerEnv: Record<string, string>) =>
  lateRunsAfterWorker(fx, { job, workerName, workerEnv, settings, thresholdMs: THRESHOLD_MS });

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
    const control = await lateRuns('right-etcd', 'worker-right', {
      HELIOS_ETCD_ENDPOINTS: leaderEtcdUrl,
    });

    // A worker whose HELIOS_ETCD_PREFIX differs (a typo), same etcd as the leader.
    const typo = await lateRuns('prefix-typo', 'worker-typo', {
      HELIOS_ETCD_ENDPOINTS: leaderEtcdUrl,
      HELIOS_ETCD_PREFIX: `${fx.etcdPrefix}-typo`,
    });

    // A worker pointed at another etcd (the shared one: its revision is far above the leader's token).
    const wrong = await lateRuns('wrong-etcd', 'worker-wrong', {
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
