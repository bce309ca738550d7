import assert from 'node:assert/strict';
import { after, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Etcd3, Lease } from 'etcd3';
import { LeaderElection, type Leadership } from '../../src/coordination/election.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { silentLogger } from '../../src/observability/logger.js';
import { serverEnv, uniqueId } from '../support/env.js';

// Interleavings of the standby's lease checks, on the real etcd (found in review of commit 005cf27).

const endpoints = serverEnv().etcdEndpoints.split(',');
const etcd = createEtcdClient(endpoints);
const prefix = `/helios-test/${uniqueId()}`;
after(async () => {
  await etcd.delete().prefix(prefix);
  etcd.close();
});

type TimeToLive = Etcd3['leaseClient']['leaseTimeToLive'];

/** Replaces the client's LeaseTimeToLive (one client per election, so only that node sees it). */
function wrapTimeToLive(
  client: Etcd3,
  wrap: (real: TimeToLive, req: Parameters<TimeToLive>[0], askedAt: number) => ReturnType<TimeToLive>,
): void {
  const real = client.leaseClient.leaseTimeToLive.bind(client.leaseClient) as TimeToLive;
  client.leaseClient.leaseTimeToLive = ((req: Parameters<TimeToLive>[0]) =>
    wrap(real, req, performance.now())) as TimeToLive;
}

function election(client: Etcd3, key: string, nodeId: string, events: string[]) {
  const state = { electedAt: null as number | null, leadership: null as Leadership | null };
  const e = new LeaderElection({
    client,
    key,
    nodeId,
    ttlMs: 3000,
    safetyMarginMs: 500,
    logger: silentLogger,
    onElected: (l) => {
      state.electedAt = performance.now();
      state.leadership = l;
      events.push(`${Math.round(performance.now())} ${nodeId} elected`);
    },
    onDemoted: (_l, reason) => events.push(`${Math.round(performance.now())} ${nodeId} demoted (${reason})`),
  });
  return { e, state };
}

test(
  'no two leaders: a zero etcd computed before a late (legitimate) renewal, reaching the standby 780 ms later, does not make it revoke the renewed lease',
  { timeout: 60_000 },
  async () => {
    const key = `${prefix}/two-leaders/leader`;
    const events: string[] = [];

    // The holder: a real LeaderElection whose keep-alives fail (injected) from its first renewal
    // until 2.35 s after it was elected; its retry (every 100 ms, while its deadline allows) then
    // renews the lease with ~0.6 s left, which is exactly what keepAlive's retry is for.
    const holderClient = createEtcdClient(endpoints);
    let failUntil = Infinity;
    const realLease = holderClient.lease.bind(holderClient);
    holderClient.lease = ((ttl: number, options?: object) => {
      const lease: Lease = realLease(ttl, options);
      const realOnce = lease.keepaliveOnce.bind(lease);
      lease.keepaliveOnce = ((...args: Parameters<Lease['keepaliveOnce']>) => {
        if (performance.now() < failUntil) return Promise.reject(new Error('injected keep-alive failure'));
        const sentAt = performance.now();
        return realOnce(...args).then((r) => {
          events.push(`${Math.round(sentAt)} holder renewed (TTL ${r.TTL})`);
          return r;
        });
      }) as Lease['keepaliveOnce'];
      return lease;
    }) as Etcd3['lease'];
    const holder = election(holderClient, key, 'holder', events);
    holder.e.start();
    while (holder.state.electedAt === null) await sleep(5);
    const e0 = holder.state.electedAt;
    failUntil = e0 + 2350;

    // The standby: one LeaseTimeToLive answer, the first asked ≥ 2.3 s after the holder's
    // election that says 0, reaches it 780 ms after etcd gave it (a slow response path, or its
    // event loop busy; under its own 1 s timeout).
    const standbyClient = createEtcdClient(endpoints);
    let slowed = false;
    wrapTimeToLive(standbyClient, async (real, req, askedAt) => {
      const answer = await real(req);
      if (!slowed && askedAt >= e0 + 2300 && Number(answer.TTL) === 0) {
        slowed = true;
        events.push(`${Math.round(askedAt)} standby asked (answer TTL 0 held back 780 ms)`);
        await sleep(780);
      }
      return answer;
    });
    const standby = election(standbyClient, key, 'standby', events);
    standby.e.start();

    let bothAt: number | null = null;
    try {
      const end = e0 + 6000;
      while (performance.now() < end) {
        if (bothAt === null && holder.e.current() && standby.e.current()) bothAt = performance.now();
        await sleep(2);
      }
      assert.ok(slowed, 'the slow answer was never given (timing of the test)');
      assert.equal(
        bothAt,
        null,
        `two nodes led at once from ${Math.round((bothAt ?? 0) - e0)} ms after the holder's election:\n` +
          events.map((line) => `  ${line}`).join('\n'),
      );
    } finally {
      await standby.e.stop();
      await holder.e.stop();
      standbyClient.close();
      holderClient.close();
    }
  },
);

test(
  'holds: a holder change between polls (key overwritten with a new lease, no delete event) does not make the standby lead',
  { timeout: 60_000 },
  async () => {
    const key = `${prefix}/overwrite/leader`;
    const l1 = etcd.lease(3, { autoKeepAlive: false });
    l1.on('lost', () => undefined);
    await l1.put(key).value(JSON.stringify({ nodeId: 'a', since: new Date().toISOString() }));
    const standbyClient = createEtcdClient(endpoints);
    const events: string[] = [];
    const revoked: string[] = [];
    const realRevoke = standbyClient.leaseClient.leaseRevoke.bind(standbyClient.leaseClient);
    standbyClient.leaseClient.leaseRevoke = ((req: { ID: string }) => {
      revoked.push(String(req.ID));
      return realRevoke(req);
    }) as typeof standbyClient.leaseClient.leaseRevoke;
    const standby = election(standbyClient, key, 'standby', events);
    standby.e.start();
    const l2 = etcd.lease(3, { autoKeepAlive: false });
    l2.on('lost', () => undefined);
    try {
      // Let the standby watch L1, then move the key to L2 (a PUT event, not a delete) and keep L2
      // alive while L1 runs out: the standby proves L1 expired and revokes it (harmless, it holds
      // nothing), then must read the key again, watch L2 and never lead while L2 is renewed.
      await sleep(1600);
      await l2.put(key).value(JSON.stringify({ nodeId: 'b', since: new Date().toISOString() }));
      for (let i = 0; i < 6; i++) {
        await sleep(900);
        await l2.keepaliveOnce();
        assert.equal(standby.state.electedAt, null, 'the standby led while L2 was renewed');
      }
      const stoppedAt = performance.now();
      while (standby.state.electedAt === null && performance.now() < stoppedAt + 6000) await sleep(10);
      assert.ok(standby.state.electedAt !== null, 'the standby never took over once L2 stopped');
      assert.ok(standby.state.electedAt - stoppedAt >= 3000 - 50, 'took over before L2 expired');
    } finally {
      await standby.e.stop();
      standbyClient.close();
      await l1.revoke().catch(() => undefined);
      await l2.revoke().catch(() => undefined);
    }
  },
);

test(
  'holds: with every LeaseTimeToLive failing the standby falls back to the watch (takes over when etcd deletes the key)',
  { timeout: 60_000 },
  async () => {
    const key = `${prefix}/ttl-fails/leader`;
    const lease = etcd.lease(3, { autoKeepAlive: false });
    lease.on('lost', () => undefined);
    await lease.put(key).value(JSON.stringify({ nodeId: 'a', since: new Date().toISOString() }));
    const renewedAt = performance.now();
    const standbyClient = createEtcdClient(endpoints);
    let calls = 0;
    wrapTimeToLive(standbyClient, async () => {
      calls++;
      throw new Error('injected LeaseTimeToLive failure');
    });
    const standby = election(standbyClient, key, 'standby', []);
    standby.e.start();
    try {
      while (standby.state.electedAt === null && performance.now() < renewedAt + 6000) await sleep(10);
      assert.ok(standby.state.electedAt !== null, 'never took over');
      const after = standby.state.electedAt - renewedAt;
      assert.ok(
        after >= 2950 && after <= 3000 + 500 + 300,
        `took over ${Math.round(after)} ms after the grant`,
      );
      assert.ok(calls > 0 && calls < 10, `${calls} LeaseTimeToLive calls (one per second expected)`);
    } finally {
      await standby.e.stop();
      standbyClient.close();
    }
  },
);

test(
  'holds: revoking a lease etcd already revoked (NotFound) does not open the member breaker',
  { timeout: 30_000 },
  async () => {
    const client = createEtcdClient(endpoints);
    try {
      const lease = client.lease(2, { autoKeepAlive: false });
      lease.on('lost', () => undefined);
      const id = await lease.grant();
      await lease.revoke();
      await assert.rejects(client.leaseClient.leaseRevoke({ ID: id }));
      const answer = await client.leaseClient.leaseTimeToLive({ ID: id });
      assert.equal(Number(answer.TTL), -1);
      // a breaker opened by the revoke would fail this at once (single member)
      await client.get(`${prefix}/anything`).string();
    } finally {
      client.close();
    }
  },
);

test(
  'liveness: a deletion that lands while a LeaseTimeToLive call is slow is acted on at once',
  { timeout: 60_000 },
  async () => {
    const key = `${prefix}/slow-ttl/leader`;
    const lease = etcd.lease(3, { autoKeepAlive: false });
    lease.on('lost', () => undefined);
    await lease.put(key).value(JSON.stringify({ nodeId: 'a', since: new Date().toISOString() }));
    const standbyClient = createEtcdClient(endpoints);
    let revokedAt: number | null = null;
    wrapTimeToLive(standbyClient, async (real, req) => {
      // The key is deleted the moment the standby's first look begins, before its watch is
      // registered (held back 200 ms below): the watch must still deliver the deletion.
      if (revokedAt === null) {
        revokedAt = performance.now();
        void lease.revoke();
      }
      await sleep(900); // a slow etcd: still under the 1 s timeout
      return real(req);
    });
    const realWatch = standbyClient.watch.bind(standbyClient);
    standbyClient.watch = () => {
      const builder = realWatch();
      const create = builder.create.bind(builder);
      builder.create = async () => {
        await sleep(200);
        return create();
      };
      return builder;
    };
    const standby = election(standbyClient, key, 'standby', []);
    standby.e.start();
    try {
      while (revokedAt === null) await sleep(1);
      while (standby.state.electedAt === null && performance.now() < revokedAt + 3000) await sleep(5);
      assert.ok(standby.state.electedAt !== null);
      const lag = standby.state.electedAt - revokedAt;
      // The watch wakes the standby in the middle of its look (the answer is not waited for).
      assert.ok(lag < 600, `took over ${Math.round(lag)} ms after the key was deleted`);
    } finally {
      await standby.e.stop();
      standbyClient.close();
    }
  },
);

test(
  'a leader whose lease another node revoked steps down at its next keep-alive, not at its own deadline',
  { timeout: 60_000 },
  async () => {
    // keepaliveOnce rejects with EtcdLeaseInvalidError when etcd answers TTL 0 (etcd3 lease.js);
    // that failure used to be retried until the deadline, as if etcd were unreachable.
    const key = `${prefix}/revoked-under/leader`;
    const client = createEtcdClient(endpoints);
    const events: string[] = [];
    const leader = election(client, key, 'leader', events);
    let demotedAt: number | null = null;
    leader.e.start();
    try {
      while (leader.state.electedAt === null) await sleep(5);
      await sleep(200);
      const kv = (await etcd.get(key).exec()).kvs[0]!;
      const revokedAt = performance.now();
      // The epoch ends when it is demoted; with no other candidate the same node may be elected
      // again a few ms later (a new epoch, on a new lease), so current() is not the test.
      const revoked = leader.state.leadership!;
      revoked.signal.addEventListener('abort', () => (demotedAt ??= performance.now()), { once: true });
      await etcd.leaseClient.leaseRevoke({ ID: kv.lease });
      while (demotedAt === null && performance.now() < revokedAt + 5000) await sleep(5);
      const ledFor = (demotedAt ?? performance.now()) - revokedAt;
      assert.ok(
        ledFor < 1200,
        `led ${Math.round(ledFor)} ms after its lease was revoked (keep-alives every 1 s):\n  ${events.join('\n  ')}`,
      );
    } finally {
      await leader.e.stop();
      client.close();
    }
  },
);

test(
  'liveness: stop() while standing by does not wait for an in-flight LeaseTimeToLive',
  { timeout: 30_000 },
  async () => {
    const key = `${prefix}/stop/leader`;
    const lease = etcd.lease(3, { autoKeepAlive: false });
    lease.on('lost', () => undefined);
    await lease.put(key).value(JSON.stringify({ nodeId: 'a', since: new Date().toISOString() }));
    const standbyClient = createEtcdClient(endpoints);
    let inFlightSince: number | null = null;
    wrapTimeToLive(standbyClient, async (real, req) => {
      inFlightSince = performance.now();
      await sleep(900);
      return real(req);
    });
    const standby = election(standbyClient, key, 'standby', []);
    standby.e.start();
    try {
      while (inFlightSince === null) await sleep(5);
      await sleep(50);
      const stopAt = performance.now();
      await standby.e.stop();
      const took = performance.now() - stopAt;
      assert.ok(took < 500, `stop() took ${Math.round(took)} ms`);
      assert.equal(standby.state.electedAt, null);
    } finally {
      standbyClient.close();
      await lease.revoke().catch(() => undefined);
    }
  },
);

test('a standby looks at a renewed lease about once a second, not twice', { timeout: 30_000 }, async () => {
  const key = `${prefix}/cadence/leader`;
  const holderClient = createEtcdClient(endpoints);
  const holder = election(holderClient, key, 'holder', []);
  holder.e.start();
  const standbyClient = createEtcdClient(endpoints);
  let looks = 0;
  wrapTimeToLive(standbyClient, (real, req) => {
    looks += 1;
    return real(req);
  });
  const standby = election(standbyClient, key, 'standby', []);
  try {
    while (holder.state.electedAt === null) await sleep(5);
    standby.e.start();
    await sleep(1000);
    looks = 0;
    await sleep(5000);
    // The 1 s re-read of the key used to cut each 900 ms wait short, for a second look ~100 ms on.
    assert.ok(looks >= 4 && looks <= 8, `${looks} looks in 5 s`);
    assert.equal(standby.state.electedAt, null);
  } finally {
    await standby.e.stop();
    await holder.e.stop();
    standbyClient.close();
    holderClient.close();
  }
});
