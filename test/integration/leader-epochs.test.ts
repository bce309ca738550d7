import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { type TestDatabase, createTestDatabase, fenceToken } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { waitFor } from '../support/execution.js';
import { nodeEnvironment, spawnFixture, stopAll, type ManagedProcess } from '../support/processes.js';

// Epochs of one node: a task of an ended epoch that is fenced out must not end the node's next epoch.

const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const prefix = `/helios-test/${uniqueId()}`;
const processes: ManagedProcess[] = [];
let db: TestDatabase;

before(async () => {
  db = await createTestDatabase();
});
after(async () => {
  await stopAll(processes);
  await etcd.delete().prefix(prefix);
  etcd.close();
  await db.drop();
});

test("a stale dispatcher of the node's previous epoch is fenced out without ending the node's new epoch", async () => {
  const env = { databaseUrl: db.url, etcdPrefix: prefix, topic: `helios.test.${uniqueId()}` };
  const node = spawnFixture(
    'epochs-1',
    'test/fixtures/hooked-node.ts',
    nodeEnvironment('epochs-1', { ...env, extra: { HELIOS_ROLES: 'scheduler,api' } }),
  );
  processes.push(node);
  const first = await node.waitForLog((l) => l.msg === 'became leader', 30_000);
  const oldToken = BigInt(first.token as string);

  // Epoch N's dispatcher passes its leadership check and is held before its fenced transaction.
  node.child.send({ hold: 'write' });
  await node.heldAt('write');

  // End epoch N from etcd's side: revoking its lease deletes the key; the node's next keep-alive
  // learns the lease is gone, and the node, the only candidate, wins epoch N+1 at once.
  const leaderKv = (await etcd.get(`${prefix}/leader`).exec()).kvs[0]!;
  await etcd.leaseClient.leaseRevoke({ ID: leaderKv.lease });
  const second = await node.waitForLog(
    (l) => l.msg === 'became leader' && BigInt(l.token as string) > oldToken,
    15_000,
  );
  const newToken = BigInt(second.token as string);
  await waitFor('epoch N+1 to raise the fence', async () => (await fenceToken(db.pool)) === newToken, 10_000);

  // Epoch N's held write goes on: the fence rejects it and its task asks to step down.
  node.child.send({ release: 'write' });
  await node.waitForLog(
    (l) => String(l.msg).startsWith('dispatch rejected by the fence') && l.token === oldToken.toString(),
    10_000,
  );
  await sleep(1500);

  const endedNew = node.logs.find((l) => l.msg === 'stepped down' && l.token === newToken.toString());
  assert.equal(
    endedNew,
    undefined,
    `epoch ${newToken} was ended by the stale task: ${JSON.stringify(endedNew)}`,
  );
  const leader = (await etcd.get(`${prefix}/leader`).exec()).kvs[0];
  assert.equal(leader?.create_revision, newToken.toString(), 'epoch N+1 still holds the leader key');
  assert.equal(await fenceToken(db.pool), newToken);
});
