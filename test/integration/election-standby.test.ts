import assert from 'node:assert/strict';
import { after, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { LeaderElection } from '../../src/coordination/election.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { silentLogger } from '../../src/observability/logger.js';
import { serverEnv, uniqueId } from '../support/env.js';

// A standby revokes the leader's lease as soon as etcd's answers prove it expired (sooner than
// etcd's own revocation loop). These pin the side that must never go wrong: a leader that renews
// late, with under a second left (etcd then answers "0 s left"), keeps its lease.

const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const prefix = `/helios-test/${uniqueId()}`;
after(async () => {
  await etcd.delete().prefix(prefix);
  etcd.close();
});

test(
  'a standby does not revoke a leader lease renewed late, and takes over once renewals stop',
  { timeout: 60_000 },
  async () => {
    const key = `${prefix}/leader`;
    // The holder: a 3 s lease renewed by hand, each time with 0.7 s left.
    const lease = etcd.lease(3, { autoKeepAlive: false });
    lease.on('lost', () => undefined);
    await lease.put(key).value(JSON.stringify({ nodeId: 'late-renewer', since: new Date().toISOString() }));
    let renewedAt = performance.now();

    let electedAt: number | null = null;
    const standbyClient = createEtcdClient(serverEnv().etcdEndpoints.split(','));
    const standby = new LeaderElection({
      client: standbyClient,
      key,
      nodeId: 'standby',
      ttlMs: 3000,
      safetyMarginMs: 500,
      logger: silentLogger,
      onElected: () => void (electedAt = performance.now()),
    });
    standby.start();
    try {
      for (let i = 0; i < 3; i++) {
        await sleep(renewedAt + 2300 - performance.now());
        const sentAt = performance.now();
        const answer = await lease.keepaliveOnce();
        assert.ok(
          Number(answer.TTL) > 0,
          `renewal ${i + 1}: the lease was gone ${Math.round(sentAt - renewedAt)} ms after the last`,
        );
        renewedAt = sentAt;
        assert.equal(
          electedAt,
          null,
          `the standby took over a lease renewed ${i} times, each with 0.7 s left`,
        );
      }
      const holder = (await etcd.get(key).exec()).kvs[0];
      assert.equal(holder?.lease, await lease.grant(), 'the late renewer still holds the key');

      // Renewals stop: the lease expires 3 s after the last, and the standby takes over.
      const deadline = renewedAt + 3000 + 2000;
      while (electedAt === null && performance.now() < deadline) await sleep(20);
      assert.ok(electedAt !== null, 'the standby did not take over within 2 s of the expiry');
      assert.ok(
        electedAt - renewedAt >= 3000,
        `took over ${Math.round(electedAt - renewedAt)} ms after the last renewal`,
      );
    } finally {
      await standby.stop();
      standbyClient.close();
      await lease.revoke().catch(() => undefined);
    }
  },
);
