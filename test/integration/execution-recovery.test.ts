import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import {
  attemptsOf,
  insertJob,
  nextWholeSecond,
  oncePerMinuteAt,
  runsOf,
  TargetServer,
  waitFor,
} from '../support/execution.js';
import { spawnNode, stopAll, type ManagedProcess } from '../support/processes.js';

const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const prefix = `/helios-test/${uniqueId()}`;
const topic = `helios.test.${uniqueId()}`;
const nodes = new Map<string, ManagedProcess>();
let db: TestDatabase;

// The first call of a run never gets an answer (its worker is killed or stopped meanwhile); later
// ones do. `/slow` answers after a second.
const target = new TargetServer((request, nth) =>
  request.path === '/slow' ? { status: 200, delayMs: 1000 } : nth === 1 ? { hang: true } : { status: 200 },
);

before(async () => {
  db = await createTestDatabase();
  await target.start();
});
after(async () => {
  await stopAll([...nodes.values()]);
  await target.close();
  await db.drop();
  await etcd.delete().prefix(prefix);
  etcd.close();
});

test(
  'kill -9 of a worker mid-call: the reaper recovers the run, another worker completes it with the same Idempotency-Key',
  { timeout: 90_000 },
  async () => {
    const env = (roles: string) => ({
      databaseUrl: db.url,
      etcdPrefix: prefix,
      topic,
      // A short grace so the claim expires soon after the run's 3 s timeout.
      extra: { HELIOS_ROLES: roles, HELIOS_CLAIM_GRACE_MS: '1000' },
    });
    nodes.set('leader', spawnNode('recover-leader', env('scheduler')));
    for (const name of ['recover-w1', 'recover-w2']) nodes.set(name, spawnNode(name, env('worker')));
    await nodes.get('leader')!.waitForLog((l) => l.msg === 'became leader', 30_000);
    for (const name of ['recover-w1', 'recover-w2']) {
      await nodes.get(name)!.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
    }

    const at = await nextWholeSecond(db.pool, 1500);
    const jobId = await insertJob(db.pool, {
      name: `victim-${uniqueId()}`,
      schedule: oncePerMinuteAt(at),
      target: { url: `${target.url}/work` },
      nextRunAt: at,
      timeoutMs: 3000,
      maxAttempts: 3,
      backoffMs: 200,
    });
    const first = await waitFor('the first call', () => target.forJob(jobId)[0], 15_000);
    const [attempt1] = await attemptsOf(db.pool, first.runId);
    const victim = nodes.get(attempt1!.nodeId)!;
    const survivor = [...nodes.keys()].find((n) => n.startsWith('recover-w') && n !== attempt1!.nodeId)!;
    victim.signal('SIGKILL');
    await victim.exited;
    const killedAt = Date.now();

    await waitFor(
      'the run to succeed',
      async () => (await runsOf(db.pool, jobId))[0]?.state === 'succeeded',
      30_000,
      100,
    );
    const calls = target.forJob(jobId);
    assert.equal(calls.length, 2);
    assert.equal(calls[0]!.aborted, true, 'the killed worker dropped the first call');
    assert.equal(calls[1]!.idempotencyKey, calls[0]!.idempotencyKey, 'the target sees the same key again');
    assert.equal(calls[1]!.idempotencyKey, first.runId);
    assert.deepEqual(
      calls.map((c) => c.attempt),
      [1, 2],
    );
    const attempts = await attemptsOf(db.pool, first.runId);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
      [
        [1, attempt1!.nodeId, 'expired'],
        [2, survivor, 'succeeded'],
      ],
    );
    assert.ok(
      nodes.get('leader')!.hasLog((l) => l.msg === 'claim expired; run recovered' && l.id === first.runId),
    );
    console.log(`# recovered ${((calls[1]!.arrivedAt - killedAt) / 1000).toFixed(1)} s after the kill`);
  },
);

/** Starts a fresh worker and waits until it has joined the group. */
async function addWorker(name: string): Promise<void> {
  const node = spawnNode(name, {
    databaseUrl: db.url,
    etcdPrefix: prefix,
    topic,
    // HELIOS_SHUTDOWN_TIMEOUT_MS is 3000 in tests: in-flight calls get 2 s to finish.
    extra: { HELIOS_ROLES: 'worker', HELIOS_CLAIM_GRACE_MS: '1000' },
  });
  nodes.set(name, node);
  await node.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
}

/** A one-shot job on `path`; returns its first call, once it arrived. */
async function callOf(path: string) {
  const at = await nextWholeSecond(db.pool, 1500);
  const jobId = await insertJob(db.pool, {
    name: `graceful-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${target.url}${path}` },
    nextRunAt: at,
    timeoutMs: 20_000,
    maxAttempts: 1,
  });
  const first = await waitFor('the first call', () => target.forJob(jobId)[0], 15_000);
  const [attempt] = await attemptsOf(db.pool, first.runId);
  return { jobId, first, worker: nodes.get(attempt!.nodeId)! };
}

test(
  'SIGTERM mid-call: a call that ends within the drain deadline completes normally',
  { timeout: 60_000 },
  async () => {
    await addWorker('graceful-a');
    await addWorker('graceful-b');
    const { jobId, worker } = await callOf('/slow');
    worker.signal('SIGTERM');
    assert.equal((await worker.exited).code, 0);
    const [run] = await runsOf(db.pool, jobId);
    assert.equal(run?.state, 'succeeded');
    assert.equal(target.forJob(jobId).length, 1);
    nodes.delete(worker.name);
  },
);

test(
  'SIGTERM mid-call: past the drain deadline the call is aborted and its claim handed back at once',
  { timeout: 60_000 },
  async () => {
    await addWorker('graceful-c');
    const { jobId, first, worker } = await callOf('/hang');
    const stoppedAt = Date.now();
    worker.signal('SIGTERM');
    assert.equal((await worker.exited).code, 0);
    const exitedAfter = Date.now() - stoppedAt;
    assert.ok(exitedAfter >= 1900 && exitedAfter < 5000, `the worker exited ${exitedAfter} ms after SIGTERM`);
    await waitFor(
      'the run to succeed elsewhere',
      async () => (await runsOf(db.pool, jobId))[0]?.state === 'succeeded',
    );
    const calls = target.forJob(jobId);
    assert.equal(calls.length, 2);
    assert.ok(calls[0]!.aborted);
    // Handed back, not expired: the second call comes well before the claim (20 s + grace) could expire.
    assert.ok(
      calls[1]!.arrivedAt - stoppedAt < 6000,
      `re-run ${calls[1]!.arrivedAt - stoppedAt} ms after SIGTERM`,
    );
    const attempts = await attemptsOf(db.pool, first.runId);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
      [
        [1, worker.name, 'cancelled'],
        [2, attempts[1]!.nodeId, 'succeeded'],
      ],
    );
    assert.notEqual(attempts[1]!.nodeId, worker.name);
    // A shutdown does not use up the run's attempts: maxAttempts was 1 and it still ran again.
    nodes.delete(worker.name);
  },
);
