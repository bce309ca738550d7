// test-runner: alone (judges how close together a herd's claims are made, in milliseconds)
import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { DbClock } from '../../src/execution/db-clock.js';
import { RunQueue } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { until } from '../support/run-queue.js';

// The queue's timing logic alone: claims and executions are fakes (the claim itself is tested
// against PostgreSQL in test/integration/execution-claims.test.ts).

const RUN_ID = '00000000-0000-4000-8000-000000000001';

function message(attempt: number): RunMessage {
  return { runId: RUN_ID, jobId: RUN_ID, attempt, scheduledFor: new Date(), notBefore: new Date() };
}

function claimed(attempt: number): ClaimedRun {
  return fakeClaimedRun(RUN_ID, attempt);
}

test('a retry announced while its previous attempt is still executing is claimed once that attempt ends', async () => {
  const claims: RunMessage[] = [];
  let finishFirst!: () => void;
  const executed: number[] = [];
  const queue = new RunQueue({
    claim: async (request) => {
      claims.push(request);
      return { kind: 'claimed', run: claimed(request.attempt) };
    },
    claimLeadMs: 0,
    claimGraceMs: 0,
    concurrency: 4,
    prefetch: 100,
    clock: new DbClock(),
    run: async (run) => {
      executed.push(run.attempt);
      // The first attempt settles (and, in real life, announces the retry) before it returns.
      if (run.attempt === 1) await new Promise<void>((resolve) => (finishFirst = resolve));
    },
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics: createMetrics('test'),
  });
  queue.hold(message(1));
  await sleep(20);
  assert.deepEqual(executed, [1]);
  queue.hold(message(2)); // arrives while attempt 1 is still executing
  queue.hold(message(1)); // a re-delivered old announcement changes nothing
  finishFirst();
  await sleep(50);
  assert.deepEqual(
    claims.map((c) => c.attempt),
    [1, 2],
  );
  assert.deepEqual(executed, [1, 2]);
  await queue.drain(100, new Error('test over'));
});

test('a forbid or replace announcement is claimed at its time, not ahead (the database refuses it early)', async () => {
  const clock = new DbClock();
  for (const concurrency of ['allow', 'forbid', 'replace'] as const) {
    const claimedIn: number[] = [];
    const due = clock.now() + 200;
    const queue = new RunQueue({
      claim: async () => {
        claimedIn.push(due - clock.now());
        return { kind: 'done' };
      },
      claimLeadMs: 100,
      claimGraceMs: 0,
      concurrency: 4,
      prefetch: 100,
      clock,
      run: async () => undefined,
      onBackpressure: () => undefined,
      logger: silentLogger,
      metrics: createMetrics('test'),
    });
    const at = new Date(due);
    queue.hold({ runId: RUN_ID, jobId: RUN_ID, attempt: 1, scheduledFor: at, notBefore: at, concurrency });
    await sleep(300);
    await queue.drain(100, new Error('test over'));
    assert.equal(claimedIn.length, 1, concurrency);
    if (concurrency === 'allow') assert.ok(claimedIn[0]! > 50, `allow claimed ${claimedIn[0]} ms ahead`);
    else assert.ok(claimedIn[0]! <= 5, `${concurrency} claimed ${claimedIn[0]} ms ahead`);
  }
});

test('a run whose call has ended gives its slot to the next while its outcome is written, at most `concurrency` of them', async () => {
  const ids = [2, 3, 4].map((n) => `00000000-0000-4000-8000-00000000000${n}`);
  const started: string[] = [];
  const settle = new Map<string, () => void>();
  const queue = new RunQueue({
    claim: async (request) => ({ kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) }),
    claimLeadMs: 0,
    claimGraceMs: 0,
    concurrency: 1,
    prefetch: 100,
    clock: new DbClock(),
    run: async (run, _signal, _drainLeftMs, callEnded) => {
      started.push(run.id);
      callEnded(); // the call is over at once; its outcome's write waits for settle()
      await new Promise<void>((resolve) => settle.set(run.id, resolve));
    },
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics: createMetrics('test'),
  });
  for (const runId of ids) {
    queue.hold({ runId, jobId: runId, attempt: 1, scheduledFor: new Date(), notBefore: new Date() });
  }
  await sleep(30);
  // The first settles in the background; the second calls in the one slot; the third waits: one
  // run settling (= concurrency) is as many as may give their slot back.
  assert.deepEqual(started, ids.slice(0, 2));
  settle.get(ids[0]!)!();
  await sleep(30);
  // The first written: the second's call had ended too, so its slot goes to the third.
  assert.deepEqual(started, ids);
  settle.get(ids[1]!)!();
  settle.get(ids[2]!)!();
  await queue.drain(100, new Error('test over'));
});

test('runs held for the same instant share one timer, fire together, and a forgotten instant leaves none', async () => {
  const clock = new DbClock();
  const timers = () => process.getActiveResourcesInfo().filter((r) => r === 'Timeout').length;
  const claimedAt: number[] = [];
  const queue = new RunQueue({
    claim: async () => {
      claimedAt.push(performance.now());
      return { kind: 'done' };
    },
    claimLeadMs: 0,
    claimGraceMs: 0,
    concurrency: 4,
    prefetch: 10_000,
    clock,
    run: async () => undefined,
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics: createMetrics('test'),
  });
  const held = (n: number, notBefore: Date): RunMessage => {
    const runId = `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;
    return { runId, jobId: runId, attempt: 1, scheduledFor: notBefore, notBefore };
  };
  // Counted around each synchronous step: a timer of another test ending meanwhile cannot skew it.
  const herd = new Date(clock.now() + 150);
  let before = timers();
  for (let n = 1; n <= 1000; n++) queue.hold(held(n, herd));
  assert.equal(timers() - before, 1, 'a thousand runs due at one instant: one timer');
  // Another instant gets its own timer; forgetting its only run (a newer attempt that is due now
  // replaces it) clears that timer.
  before = timers();
  queue.hold(held(5000, new Date(clock.now() + 60_000)));
  assert.equal(timers() - before, 1, 'a second instant: a second timer');
  before = timers();
  queue.hold({ ...held(5000, new Date()), attempt: 2 });
  assert.equal(before - timers(), 1, 'the instant without runs left has no timer');
  await until(() => claimedAt.length === 1, 'the newer attempt claimed at once', 1_000);
  await until(() => claimedAt.length === 1001, 'the herd claimed', 2_000);
  const herdClaims = claimedAt.slice(1);
  // One wake-up: every claim of the herd is tried in the same turn of the event loop.
  const spread = Math.max(...herdClaims) - Math.min(...herdClaims);
  assert.ok(spread < 50, `claimed together (within ${Math.round(spread)} ms)`);
  await queue.drain(100, new Error('test over'));
});
