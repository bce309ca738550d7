import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Etcd3, Watcher } from 'etcd3';
import { LeaderElection, readLeader, type Leadership } from '../../src/coordination/election.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { silentLogger } from '../../src/observability/logger.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { EtcdServer } from '../support/etcd-server.js';
import { TcpProxy } from '../support/tcp-proxy.js';

// The election under what operators do to an etcd that has run for months: compaction (Kubernetes
// compacts every 5 minutes), a watch stream that breaks and resumes after one, an operator deleting
// the leader key (or the whole HELIOS_ETCD_PREFIX). On an etcd of the test's own: it is compacted.

const etcdPort = Number(new URL(serverEnv().etcdEndpoints.split(',')[0]!).port) + 70;
let server: EtcdServer;
let admin: Etcd3;
const prefix = `/helios-test/${uniqueId()}`;

before(async () => {
  server = await EtcdServer.start('operations', etcdPort);
  admin = createEtcdClient([server.url]);
});
after(async () => {
  admin.close();
  await server.stop();
});

function election(client: Etcd3, key: string, nodeId: string) {
  const state = {
    elected: [] as { at: number; leadership: Leadership }[],
    demoted: [] as { at: number; token: bigint; reason: string }[],
  };
  const e = new LeaderElection({
    client,
    key,
    nodeId,
    ttlMs: 3000,
    safetyMarginMs: 500,
    logger: silentLogger,
    onElected: (leadership) => state.elected.push({ at: performance.now(), leadership }),
    onDemoted: (l, reason) => state.demoted.push({ at: performance.now(), token: l.token, reason }),
  });
  return { e, state };
}

async function until(what: string, check: () => boolean, timeoutMs: number): Promise<void> {
  const deadline = performance.now() + timeoutMs;
  while (!check()) {
    if (performance.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(5);
  }
}

/** Moves etcd's revision on (other writers: the node registry writes every 5 s) and compacts all of it. */
async function compactEverything(): Promise<string> {
  for (let i = 0; i < 20; i++) await admin.put(`${prefix}/other`).value(String(i));
  const revision = (await admin.get(`${prefix}/other`).exec()).header.revision;
  await admin.kv.compact({ revision, physical: true });
  return revision;
}

test(
  "a standby's watch that etcd cancelled (its stream resumed at a compacted revision) is made again: a graceful handover stays immediate",
  { timeout: 60_000 },
  async () => {
    const key = `${prefix}/compacted-watch/leader`;
    const proxy = new TcpProxy('127.0.0.1', etcdPort);
    await proxy.listen();
    const leaderClient = createEtcdClient([server.url]);
    // The standby reaches etcd through a proxy whose connections the test drops.
    const standbyClient = createEtcdClient([`http://127.0.0.1:${proxy.port}`]);
    const watchEvents: string[] = [];
    const realWatch = standbyClient.watch.bind(standbyClient);
    standbyClient.watch = () => {
      const builder = realWatch();
      const create = builder.create.bind(builder);
      builder.create = async (): Promise<Watcher> => {
        const watcher = await create();
        const n = watchEvents.filter((e) => e.startsWith('created')).length + 1;
        watchEvents.push(`created ${n}`);
        watcher.on('connected', () => watchEvents.push(`connected ${n}`));
        watcher.on('error', (err) => watchEvents.push(`cancelled ${n}: ${(err as Error).message}`));
        return watcher;
      };
      return builder;
    };
    // When each of the standby's looks at the leader's lease was answered.
    const looks: number[] = [];
    const realTtl = standbyClient.leaseClient.leaseTimeToLive.bind(standbyClient.leaseClient);
    standbyClient.leaseClient.leaseTimeToLive = (async (req: { ID: string }) => {
      const answer = await realTtl(req);
      looks.push(performance.now());
      return answer;
    }) as typeof standbyClient.leaseClient.leaseTimeToLive;

    const leader = election(leaderClient, key, 'leader');
    const standby = election(standbyClient, key, 'standby');
    leader.e.start();
    try {
      await until('the leader', () => leader.state.elected.length === 1, 5000);
      standby.e.start();
      await until('the standby to watch the key', () => watchEvents.includes('created 1'), 5000);

      // Months in a second: the revision moves on and is compacted; then the standby's connections
      // drop (a restarted member, a network blip), and its watch resumes from its last revision.
      await compactEverything();
      proxy.heal();
      await until(
        'etcd to cancel the resumed watch',
        () => watchEvents.some((e) => e.startsWith('cancelled 1')),
        15_000,
      );
      await sleep(1500); // what the standby does after it

      // Stopped just after a look at its lease: the next look comes ~900 ms later, so only the
      // watch can wake the standby sooner.
      const seen = looks.length;
      await until('a look at the lease', () => looks.length > seen, 3000);
      await sleep(50);
      const stoppedAt = performance.now();
      await leader.e.stop();
      await until('the standby to lead', () => standby.state.elected.length === 1, 5000);
      const tookMs = standby.state.elected[0]!.at - stoppedAt;
      assert.ok(
        tookMs < 300,
        `the standby led ${Math.round(tookMs)} ms after a graceful stop (watch: ${watchEvents.join(', ')})`,
      );
    } finally {
      await standby.e.stop();
      await leader.e.stop();
      standbyClient.close();
      leaderClient.close();
      await proxy.close();
    }
  },
);

test(
  'a leader whose key an operator deleted (its lease left alive) steps down: never two leaders for more than a keep-alive',
  { timeout: 60_000 },
  async () => {
    const key = `${prefix}/deleted-key/leader`;
    const clients = [createEtcdClient([server.url]), createEtcdClient([server.url])];
    const a = election(clients[0]!, key, 'a');
    const b = election(clients[1]!, key, 'b');
    a.e.start();
    try {
      await until('a to lead', () => a.state.elected.length === 1, 5000);
      b.e.start();
      await sleep(1500);
      const deletedAt = performance.now();
      await admin.delete().key(key); // etcdctl del <prefix>/leader
      await until('b to lead', () => b.state.elected.length === 1, 3000);
      await sleep(1500);
      const both = a.e.current() !== null && b.e.current() !== null;
      assert.ok(
        !both,
        `two leaders 1.5 s after b was elected (a's epoch ${a.state.elected[0]!.leadership.token} still valid)`,
      );
      const ended = a.state.demoted[0];
      assert.ok(ended, 'a never stepped down');
      assert.ok(ended.at - deletedAt < 1300, `a stepped down ${Math.round(ended.at - deletedAt)} ms after`);
    } finally {
      await b.e.stop();
      await a.e.stop();
      for (const c of clients) c.close();
    }
  },
);

test(
  'a lone leader whose key was deleted (etcdctl del --prefix of HELIOS_ETCD_PREFIX) leads again under a new key',
  { timeout: 60_000 },
  async () => {
    const base = `${prefix}/wiped`;
    const key = `${base}/leader`;
    const client = createEtcdClient([server.url]);
    const lone = election(client, key, 'lone');
    lone.e.start();
    try {
      await until('the leader', () => lone.state.elected.length === 1, 5000);
      const first = lone.state.elected[0]!.leadership;
      await sleep(500);
      await admin.delete().prefix(base);
      await sleep(2000);
      const record = await readLeader(admin, key);
      assert.ok(record, 'no leader key 2 s after it was deleted, while a node leads');
      assert.equal(record.nodeId, 'lone');
      assert.ok(record.token > first.token, 'a new epoch, with a new token');
      assert.ok(first.signal.aborted, 'the epoch whose key was deleted ended');
      assert.equal(lone.e.current()?.token, record.token);
    } finally {
      await lone.e.stop();
      client.close();
    }
  },
);
