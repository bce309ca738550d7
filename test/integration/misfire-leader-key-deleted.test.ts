import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { readLeader } from '../../src/coordination/election.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { lateRunsAfterWorker } from '../support/late-runs.js';

// An operator deletes the leader key (`etcdctl del <prefix>/leader`, or `del --prefix` of the whole
// HELIOS_ETCD_PREFIX) and leaves the lease, so the leader's keep-alives go on succeeding. A leader
// that never noticed led on without a key: the cluster view said nobody leads, and the workers,
// reading "no leader key at revision R" from etcd (EndedEpochs), took its epoch for ended and
// dropped its late runs as misfires, though a run whose leader still leads is only ever delayed
// (README, Misfires).

const THRESHOLD_MS = 2000;
const settings = {
  HELIOS_DISPATCH_LOOKAHEAD_MS: '3000',
  HELIOS_MISFIRE_THRESHOLD_MS: String(THRESHOLD_MS),
};
let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture();
});
after(async () => {
  await fx.teardown();
});

test(
  'a leader whose key an operator deleted leads again under a key: its late runs are delayed, not dropped',
  { timeout: 120_000 },
  async () => {
    const leader = await fx.start('leader', { ...settings, HELIOS_ROLES: 'scheduler,api' }, { leader: true });
    const key = `${fx.etcdPrefix}/leader`;
    const before = await readLeader(fx.etcd, key);
    assert.ok(before);
    await fx.etcd.delete().key(key);
    await sleep(2000);

    const rows = await lateRunsAfterWorker(fx, {
      job: 'after-delete',
      workerName: 'worker',
      workerEnv: {},
      settings,
      thresholdMs: THRESHOLD_MS,
    });
    const after = await readLeader(fx.etcd, key);
    assert.ok(rows.length >= 2, `${rows.length} late runs`);
    assert.deepEqual(
      rows
        .filter((r) => r.state !== 'succeeded')
        .map((r) => `${r.state} ${r.reason} (epoch ${r.createdEpoch})`),
      [],
      `late runs of the live leader dropped (its key: ${after ? `epoch ${after.token}` : 'none'}, before the delete: epoch ${before.token})`,
    );
    assert.ok(after, 'no leader key, while the node leads');
    assert.equal(after.nodeId, 'leader');
    assert.ok(leader.node.running);
  },
);
