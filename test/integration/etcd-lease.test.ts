import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { NodeRegistry, listNodes } from '../../src/coordination/registry.js';
import { silentLogger } from '../../src/observability/logger.js';
import { serverEnv, uniqueId } from '../support/env.js';

const client = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const prefix = `/helios-test/${uniqueId()}`;
after(async () => {
  await client.delete().prefix(prefix);
  client.close();
});

test('a key bound to a lease disappears when the lease is revoked', async () => {
  const lease = client.lease(10);
  await lease.put(`${prefix}/revoked`).value('x');
  assert.equal(await client.get(`${prefix}/revoked`).string(), 'x');
  await lease.revoke();
  assert.equal(await client.get(`${prefix}/revoked`).string(), null);
});

test('a key bound to a lease disappears when the lease expires without keep-alives', async () => {
  const lease = client.lease(2, { autoKeepAlive: false });
  lease.on('lost', () => undefined);
  await lease.put(`${prefix}/expires`).value('x');
  assert.equal(await client.get(`${prefix}/expires`).string(), 'x');
  const start = Date.now();
  while ((await client.get(`${prefix}/expires`).string()) !== null) {
    assert.ok(Date.now() - start < 6000, 'key still present 6 s after a 2 s lease');
    await sleep(100);
  }
  assert.ok(Date.now() - start >= 1000, 'key vanished before its lease could have expired');
});

test('a node registers under a lease and disappears when it stops', async () => {
  const registry = new NodeRegistry({
    client,
    prefix,
    info: { id: 'node-a', host: 'h', pid: 1, apiUrl: 'http://127.0.0.1:1', roles: ['worker'] },
    logger: silentLogger,
  });
  await registry.start();
  const nodes = await listNodes(client, prefix);
  assert.deepEqual(
    nodes.map((n) => [n.id, n.apiUrl, n.roles]),
    [['node-a', 'http://127.0.0.1:1', ['worker']]],
  );
  await registry.stop();
  await registry.stop(); // safe twice
  assert.deepEqual(await listNodes(client, prefix), []);
});
