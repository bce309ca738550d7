// test-runner: alone (stops and starts the shared servers)
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { listNodes } from '../../src/coordination/registry.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { infra, type ManagedProcess } from '../support/processes.js';

let fx: IntegrationFixture;
let node: ManagedProcess | undefined;

before(async () => {
  fx = await integrationFixture();
});
after(async () => {
  await infra('up', 'pg'); // whatever happened, leave PostgreSQL running for the next file
  await fx.teardown();
});

async function readyz(url: string) {
  const response = await fetch(`${url}/readyz`);
  return { status: response.status, body: (await response.json()) as { failing: string[] } };
}

test('a node boots, registers, reports readiness, and names PostgreSQL when it is stopped', async () => {
  node = fx.spawn('boot-1');
  const started = await node.waitForLog((l) => l.msg === 'node started');
  const apiUrl = started.apiUrl as string;

  assert.equal((await fetch(`${apiUrl}/healthz`)).status, 200);
  // A node starts before its Kafka topics are ensured (it must start while Kafka is down), so
  // right after "node started" Kafka may still be named as degraded; on a fresh broker creating
  // the topic takes a few seconds. Wait for the first round in which everything answered.
  const ready = await waitFor('every dependency ready', async () => {
    const r = await readyz(apiUrl);
    return r.body.failing.length === 0 ? r : undefined;
  });
  assert.equal(ready.status, 200);

  const nodes = await listNodes(fx.etcd, fx.etcdPrefix);
  assert.deepEqual(
    nodes.map((n) => [n.id, n.apiUrl, n.pid]),
    [['boot-1', apiUrl, node.pid]],
  );

  await infra('down', 'pg');
  try {
    // /readyz answers from a probe round at most 1 s old: the outage shows within a second.
    const seenAt = Date.now();
    let down = await readyz(apiUrl);
    while (down.status === 200 && Date.now() - seenAt < 3000) {
      await new Promise((r) => setTimeout(r, 200));
      down = await readyz(apiUrl);
    }
    assert.equal(down.status, 503);
    assert.deepEqual(down.body.failing, ['postgres']);
    assert.equal((await fetch(`${apiUrl}/healthz`)).status, 200, 'the process itself is still healthy');
  } finally {
    await infra('up', 'pg');
  }
  // The pool reconnects on its own once PostgreSQL is back.
  const deadline = Date.now() + 10_000;
  let again = await readyz(apiUrl);
  while (again.status !== 200 && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 200));
    again = await readyz(apiUrl);
  }
  assert.equal(again.status, 200);
});

test('SIGTERM stops the node within a few seconds and removes its registration', async () => {
  assert.ok(node?.running);
  const start = Date.now();
  node.signal('SIGTERM');
  const exit = await node.exited;
  assert.equal(exit.code, 0, node.stderr.join('\n'));
  assert.ok(Date.now() - start < 5000, `shutdown took ${Date.now() - start} ms`);
  assert.ok(node.hasLog((l) => l.msg === 'node stopped'));
  assert.deepEqual(await listNodes(fx.etcd, fx.etcdPrefix), []);
});
