import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { TargetServer, waitFor } from '../support/execution.js';
import { apiCall, startNode } from '../support/node-api.js';
import { stopAll, type ManagedProcess } from '../support/processes.js';

// `forbid` skips a fresh occurrence while another run of the job is active. A retry or a replay is
// not a fresh occurrence: skipping it would lose a run without a dead letter. It waits its turn.

const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const prefix = `/helios-test/${uniqueId()}`;
const topic = `helios.test.${uniqueId()}`;
const failing = new Set<string>();
const slow = new Set<string>();
const target = new TargetServer((request, nth) => {
  if (failing.has(request.runId) && nth === 1) return { status: 500 };
  if (slow.has(request.runId)) return { status: 200, delayMs: 3000 };
  return { status: 200 };
});
const nodes: ManagedProcess[] = [];
let db: TestDatabase;
let api: string;

const call = <T>(method: string, path: string, body?: unknown) => apiCall<T>(api, method, path, body);

async function run(id: string) {
  const { rows } = await db.pool.query<{ state: string; reason: string | null; attempt: number }>(
    'SELECT state, reason, attempt FROM runs WHERE id = $1',
    [id],
  );
  return rows[0]!;
}

before(async () => {
  db = await createTestDatabase();
  await target.start();
  const started = await startNode('forbid-1', { databaseUrl: db.url, etcdPrefix: prefix, topic });
  nodes.push(started.node);
  api = started.apiUrl;
});
after(async () => {
  await stopAll(nodes);
  await target.close();
  await db.drop();
  await etcd.delete().prefix(prefix);
  etcd.close();
});

test('forbid: a dead-letter replay while another run of the job runs waits its turn and runs', async () => {
  const job = await call<{ id: string }>('POST', '/jobs', {
    name: `forbid-replay-${uniqueId()}`,
    schedule: '0 0 1 1 *', // never during the test: only manual runs
    target: { url: `${target.url}/forbid-replay`, method: 'POST' },
    concurrency: 'forbid',
    retry: { maxAttempts: 1, backoffMs: 100 },
  });
  // A run that fails its only attempt: dead, with an open dead letter.
  const dead = await call<{ runId: string }>('POST', `/jobs/${job.id}/trigger`);
  failing.add(dead.runId);
  await waitFor('the first run to be dead', async () => (await run(dead.runId)).state === 'dead');
  // Another run of the job, whose call takes 3 s.
  const busy = await call<{ runId: string }>('POST', `/jobs/${job.id}/trigger`);
  slow.add(busy.runId);
  await waitFor('the slow run to reach the target', () =>
    target.requests.some((r) => r.runId === busy.runId),
  );
  const letters = await call<{ items: { id: string; runId: string }[] }>('GET', '/dead-letters?open=true');
  const letter = letters.items.find((l) => l.runId === dead.runId)!;
  await call('POST', `/dead-letters/${letter.id}/replay`);

  const replayed = await waitFor(
    'the replayed run to finish',
    async () => {
      const state = await run(dead.runId);
      return ['succeeded', 'skipped', 'dead', 'failed'].includes(state.state) ? state : null;
    },
    20_000,
  );
  assert.equal(replayed.state, 'succeeded', `the replay ended ${replayed.state} (${replayed.reason})`);
  const busyCall = target.requests.find((r) => r.runId === busy.runId)!;
  const replayCall = target.requests.filter((r) => r.runId === dead.runId)[1]!;
  assert.ok(replayCall, 'the replay reached the target');
  assert.ok(
    replayCall.arrivedAt >= busyCall.endedAt!,
    'the replay started only after the other run of the forbid job ended',
  );
});
