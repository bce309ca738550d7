import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { readFence } from '../../src/store/fence.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { EtcdServer } from '../support/etcd-server.js';
import { insertJob, nextWholeSecond, runsOf, stopJobs, TargetServer, waitFor } from '../support/execution.js';
import {
  nodeEnvironment,
  runCli,
  spawnNode,
  stopAll,
  type ManagedProcess,
  type NodeEnv,
} from '../support/processes.js';

// Replacing etcd (a fresh data set, as after a restore from an old backup or a rebuild) restarts
// its revisions below the token PostgreSQL's fence holds: no leader can write until the operator
// runs `helios fence reset`. Two real etcd servers: the worktree's, and a fresh one started here
// on the next two ports after the worktree's etcd client and peer ports.

const mainEtcdUrl = serverEnv().etcdEndpoints.split(',')[0]!;
const freshPort = Number(new URL(mainEtcdUrl).port) + 2;
const freshUrl = `http://127.0.0.1:${freshPort}`;
const mainEtcd = createEtcdClient([mainEtcdUrl]);
const prefix = `/helios-test/${uniqueId()}`;
const target = new TargetServer();
const nodes: ManagedProcess[] = [];
let db: TestDatabase;
let fresh: EtcdServer | undefined;

before(async () => {
  db = await createTestDatabase();
  await target.start();
});
after(async () => {
  await stopAll(nodes);
  await fresh?.stop();
  await target.close();
  await db.drop();
  await mainEtcd.delete().prefix(prefix);
  mainEtcd.close();
});

function env(etcdUrl: string): NodeEnv {
  return {
    databaseUrl: db.url,
    etcdPrefix: prefix,
    topic: `helios.test.${uniqueId()}`,
    extra: { HELIOS_ROLES: 'scheduler,worker,api', HELIOS_ETCD_ENDPOINTS: etcdUrl },
  };
}

function startNode(name: string, etcdUrl: string): ManagedProcess {
  const node = spawnNode(name, env(etcdUrl));
  nodes.push(node);
  return node;
}

/** Runs `helios fence <sub>` against the fresh etcd, as an operator would. */
function fence(sub: string) {
  return runCli(['fence', sub], nodeEnvironment('operator', env(freshUrl)));
}

test(
  'after etcd is replaced no leader can write until `helios fence reset`, which refuses while a leader holds the key',
  { timeout: 180_000 },
  async () => {
    // The old etcd has seen many revisions; a fresh one starts at 1.
    for (let i = 0; i < 30; i++) await mainEtcd.put(`${prefix}/bump`).value(String(i));
    const old = startNode('fence-old', mainEtcdUrl);
    const elected = await old.waitForLog((l) => l.msg === 'became leader', 30_000);
    const oldToken = BigInt(elected.token as string);
    await waitFor(
      'the old leader to raise the fence',
      async () => (await readFence(db.pool)).token === oldToken,
      10_000,
    );
    await old.stop();

    fresh = await EtcdServer.start('fresh', freshPort);
    const stuck = startNode('fence-stuck', freshUrl);
    const stuckElected = await stuck.waitForLog((l) => l.msg === 'became leader', 30_000);
    assert.ok(BigInt(stuckElected.token as string) < oldToken, 'the fresh etcd hands out a lower token');
    await stuck.waitForLog((l) => String(l.msg).startsWith('dispatch rejected by the fence'), 15_000);
    await stuck.stop();

    const status = await fence('status');
    assert.equal(status.code, 0, status.stderr);
    assert.match(status.stdout, /the fence is ahead of etcd/);

    const reset = await fence('reset');
    assert.equal(reset.code, 0, reset.stderr);
    const lowered = await readFence(db.pool);
    assert.ok(lowered.token < oldToken, `fence lowered: ${lowered.token}`);
    assert.match(reset.stdout, new RegExp(`fence reset from ${oldToken} to ${lowered.token}`));

    // A leader elected in the fresh etcd now writes: a job runs.
    const jobId = await insertJob(db.pool, {
      name: `after-reset-${uniqueId()}`,
      schedule: '* * * * * *',
      target: { url: `${target.url}/after-reset` },
      nextRunAt: await nextWholeSecond(db.pool, 500),
    });
    const healed = startNode('fence-healed', freshUrl);
    await healed.waitForLog((l) => l.msg === 'became leader', 30_000);
    await waitFor(
      'a run after the reset',
      async () => (await runsOf(db.pool, jobId)).some((r) => r.state === 'succeeded'),
      20_000,
      200,
    );
    assert.equal(
      healed.hasLog((l) => String(l.msg).includes('rejected by the fence')),
      false,
    );

    // With a leader holding the key, a reset is refused and changes nothing.
    const fenceBefore = (await readFence(db.pool)).token;
    const refused = await fence('reset');
    assert.equal(refused.code, 1);
    assert.match(refused.stderr, /refusing to reset the fence while fence-healed holds/);
    await sleep(200);
    assert.ok((await readFence(db.pool)).token >= fenceBefore, 'the refused reset lowered nothing');
    await stopJobs(db.pool, [jobId]);
  },
);
