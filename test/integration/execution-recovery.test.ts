import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import {
  attemptsOf,
  insertJob,
  nextWholeSecond,
  oncePerMinuteAt,
  runsOf,
  waitFor,
} from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import type { ManagedProcess } from '../support/processes.js';

let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture({
    // The first call of a run never gets an answer (its worker is killed or stopped meanwhile);
    // later ones do. `/slow` answers after a second.
    behaviour: (request, nth) =>
      request.path === '/slow'
        ? { status: 200, delayMs: 1000 }
        : nth === 1
          ? { hang: true }
          : { status: 200 },
  });
});
after(() => fx.teardown());

/** The node of this file named `name` (node ids are the names). */
const node = (name: string): ManagedProcess => fx.nodes.find((n) => n.name === name)!;

test(
  'kill -9 of a worker mid-call: the reaper recovers the run, another worker completes it with the same Idempotency-Key',
  { timeout: 90_000 },
  async () => {
    // A short grace so the claim expires soon after the run's 3 s timeout.
    const env = (roles: string) => ({ HELIOS_ROLES: roles, HELIOS_CLAIM_GRACE_MS: '1000' });
    fx.spawn('recover-leader', env('scheduler'));
    for (const name of ['recover-w1', 'recover-w2']) fx.spawn(name, env('worker'));
    await node('recover-leader').waitForLog((l) => l.msg === 'became leader', 30_000);
    for (const name of ['recover-w1', 'recover-w2']) {
      await node(name).waitForLog((l) => l.msg === 'joined consumer group', 30_000);
    }

    const at = await nextWholeSecond(fx.db.pool, 1500);
    const jobId = await insertJob(fx.db.pool, {
      name: `victim-${uniqueId()}`,
      schedule: oncePerMinuteAt(at),
      target: { url: `${fx.target.url}/work` },
      nextRunAt: at,
      timeoutMs: 3000,
      maxAttempts: 3,
      backoffMs: 200,
    });
    const first = await waitFor('the first call', () => fx.target.forJob(jobId)[0], 15_000);
    const [attempt1] = await attemptsOf(fx.db.pool, first.runId);
    const victim = node(attempt1!.nodeId);
    const survivor = fx.nodes
      .map((n) => n.name)
      .find((n) => n.startsWith('recover-w') && n !== attempt1!.nodeId)!;
    victim.signal('SIGKILL');
    await victim.exited;
    const killedAt = Date.now();

    await waitFor(
      'the run to succeed',
      async () => (await runsOf(fx.db.pool, jobId))[0]?.state === 'succeeded',
      30_000,
      100,
    );
    const calls = fx.target.forJob(jobId);
    assert.equal(calls.length, 2);
    assert.equal(calls[0]!.aborted, true, 'the killed worker dropped the first call');
    assert.equal(calls[1]!.idempotencyKey, calls[0]!.idempotencyKey, 'the target sees the same key again');
    assert.equal(calls[1]!.idempotencyKey, first.runId);
    assert.deepEqual(
      calls.map((c) => c.attempt),
      [1, 2],
    );
    const attempts = await attemptsOf(fx.db.pool, first.runId);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
      [
        [1, attempt1!.nodeId, 'expired'],
        [2, survivor, 'succeeded'],
      ],
    );
    assert.ok(
      node('recover-leader').hasLog((l) => l.msg === 'claim expired; run recovered' && l.id === first.runId),
    );
    console.log(`# recovered ${((calls[1]!.arrivedAt - killedAt) / 1000).toFixed(1)} s after the kill`);
  },
);

/** Starts a fresh worker and waits until it has joined the group. */
async function addWorker(name: string): Promise<void> {
  // HELIOS_SHUTDOWN_TIMEOUT_MS is 3000 in tests: in-flight calls get 2 s to finish.
  const worker = fx.spawn(name, { HELIOS_ROLES: 'worker', HELIOS_CLAIM_GRACE_MS: '1000' });
  await worker.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
}

/** A one-shot job on `path`; returns its first call, once it arrived. */
async function callOf(path: string) {
  const at = await nextWholeSecond(fx.db.pool, 1500);
  const jobId = await insertJob(fx.db.pool, {
    name: `graceful-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${fx.target.url}${path}` },
    nextRunAt: at,
    timeoutMs: 20_000,
    maxAttempts: 1,
  });
  const first = await waitFor('the first call', () => fx.target.forJob(jobId)[0], 15_000);
  const [attempt] = await attemptsOf(fx.db.pool, first.runId);
  return { jobId, first, worker: node(attempt!.nodeId) };
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
    const [run] = await runsOf(fx.db.pool, jobId);
    assert.equal(run?.state, 'succeeded');
    assert.equal(fx.target.forJob(jobId).length, 1);
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
      async () => (await runsOf(fx.db.pool, jobId))[0]?.state === 'succeeded',
    );
    const calls = fx.target.forJob(jobId);
    assert.equal(calls.length, 2);
    assert.ok(calls[0]!.aborted);
    // Handed back, not expired: the second call comes well before the claim (20 s + grace) could expire.
    assert.ok(
      calls[1]!.arrivedAt - stoppedAt < 6000,
      `re-run ${calls[1]!.arrivedAt - stoppedAt} ms after SIGTERM`,
    );
    const attempts = await attemptsOf(fx.db.pool, first.runId);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
      [
        [1, worker.name, 'cancelled'],
        [2, attempts[1]!.nodeId, 'succeeded'],
      ],
    );
    assert.notEqual(attempts[1]!.nodeId, worker.name);
    // A shutdown does not use up the run's attempts: maxAttempts was 1 and it still ran again.
  },
);
