import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { readLeader } from '../../src/coordination/election.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { spawnNode, stopAll, type ManagedProcess, type NodeEnv } from '../support/processes.js';

const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
let db: TestDatabase;
let env: NodeEnv;
const processes: ManagedProcess[] = [];
const TTL_MS = 3000;

before(async () => {
  db = await createTestDatabase();
});
after(async () => {
  await stopAll(processes);
  await etcd.delete().prefix(env.etcdPrefix);
  etcd.close();
  await db.drop();
});

interface Epoch {
  node: string;
  token: bigint;
  start: number;
  end: number;
}

/** Each node's own view of its leadership, from its log: [became leader, stepped down or killed). */
function epochsFromLogs(nodes: ManagedProcess[], killedAt: Map<ManagedProcess, number>): Epoch[] {
  const epochs: Epoch[] = [];
  for (const node of nodes) {
    let open: Epoch | undefined;
    for (const line of node.logs) {
      if (line.msg === 'became leader') {
        open = {
          node: node.name,
          token: BigInt(line.token as string),
          start: Date.parse(line.time as string),
          end: Infinity,
        };
        epochs.push(open);
      } else if (line.msg === 'stepped down' && open) {
        open.end = Date.parse(line.time as string);
        open = undefined;
      }
    }
    if (open && killedAt.has(node)) open.end = killedAt.get(node)!;
  }
  return epochs.sort((a, b) => Number(a.token - b.token));
}

function start(name: string): ManagedProcess {
  const node = spawnNode(name, { ...env, extra: { HELIOS_ROLES: 'scheduler,api' } });
  processes.push(node);
  return node;
}

async function leaderOf(nodes: ManagedProcess[], timeoutMs: number): Promise<ManagedProcess> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const record = await readLeader(etcd, `${env.etcdPrefix}/leader`);
    const node = record && nodes.find((n) => n.name === record.nodeId && n.running);
    if (node) return node;
    await sleep(20);
  }
  throw new Error('no leader');
}

for (const count of [2, 3]) {
  test(`${count} candidates in separate processes: never two leaders, kill -9 fails over within TTL + 1 s`, async () => {
    env = {
      databaseUrl: db.url,
      etcdPrefix: `/helios-test/${uniqueId()}`,
      topic: `helios.test.${uniqueId()}`,
    };
    const nodes = Array.from({ length: count }, (_, i) => start(`c${count}-${i}`));
    await Promise.all(nodes.map((n) => n.waitForLog((l) => l.msg === 'node started')));
    const killedAt = new Map<ManagedProcess, number>();
    const tokensSeen: bigint[] = [];
    let sampling = true;
    const sampler = (async () => {
      while (sampling) {
        const record = await readLeader(etcd, `${env.etcdPrefix}/leader`).catch(() => null);
        if (record) tokensSeen.push(record.token);
        await sleep(25);
      }
    })();

    const failovers: number[] = [];
    for (let round = 0; round < 4; round++) {
      const leader = await leaderOf(nodes, 10_000);
      const others = nodes.filter((n) => n !== leader && n.running);
      if (round % 2 === 0) {
        // kill -9: the lease must expire; another node must lead within TTL + 1 s.
        const killed = Date.now();
        killedAt.set(leader, killed);
        leader.signal('SIGKILL');
        const next = await leaderOf(others, TTL_MS + 3000);
        const line = await next.waitForLog(
          (l) => l.msg === 'became leader' && Date.parse(l.time as string) >= killed,
        );
        failovers.push(Date.parse(line.time as string) - killed);
      } else {
        // graceful: the leader deletes its key on the way out, so failover is immediate.
        await leader.stop();
        await leaderOf(others, 2000);
      }
      // Replace the departed node so the count of candidates stays the same.
      const replacement = start(`c${count}-r${round}`);
      nodes.splice(nodes.indexOf(leader), 1, replacement);
      await replacement.waitForLog((l) => l.msg === 'node started');
    }
    sampling = false;
    await sampler;
    const all = processes.filter((p) => p.name.startsWith(`c${count}-`));
    await stopAll(all);

    for (const ms of failovers) assert.ok(ms <= TTL_MS + 1000, `failover took ${ms} ms (> TTL + 1 s)`);
    const epochs = epochsFromLogs(all, killedAt);
    assert.ok(epochs.length >= 5, `expected at least 5 epochs, saw ${epochs.length}`);
    for (let i = 1; i < epochs.length; i++) {
      const prev = epochs[i - 1]!;
      const next = epochs[i]!;
      assert.ok(next.token > prev.token, 'fencing tokens grow');
      assert.ok(
        prev.end <= next.start,
        `${prev.node} (token ${prev.token}) still led at ${prev.end} when ${next.node} became leader at ${next.start}`,
      );
    }
    for (let i = 1; i < tokensSeen.length; i++)
      assert.ok(tokensSeen[i]! >= tokensSeen[i - 1]!, 'etcd token went back');
    console.log(`failover after kill -9 (ms): ${failovers.join(', ')}`);
  });
}
