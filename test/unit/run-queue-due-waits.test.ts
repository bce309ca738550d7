import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { RunMessage } from '../../src/execution/run-message.js';
import type { RunQueue } from '../../src/execution/run-queue.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { MovableClock, testRunQueue, until } from '../support/run-queue.js';

// Runs claimed ahead wait for their not_before on one timer per instant (run-queue.ts, DueWait),
// not on a promise timer each. Fakes only: what the sharing must keep is that no call starts
// before its instant by the clock estimate, that the runs of an instant get their slots in the
// order they were claimed, and that an aborted wait ends at once and leaves no timer behind.

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

const announce = (runId: string, notBefore: Date): RunMessage => ({
  runId,
  jobId: runId,
  attempt: 1,
  scheduledFor: notBefore,
  notBefore,
});

interface Internals {
  dueWaits: Map<number, { timer: NodeJS.Timeout; waiters: Set<() => void> }>;
}
const dueWaits = (queue: RunQueue) => (queue as unknown as Internals).dueWaits;
/** Node marks a Timeout destroyed once it has fired or been cleared: alive, it keeps the process up. */
const alive = (timer: NodeJS.Timeout) => !(timer as unknown as { _destroyed: boolean })._destroyed;

/**
 * A queue that claims every run ahead (lead `leadMs`, slots to spare) with not_before `due`, and
 * records, per call, the run and how late it began by the queue's clock (negative: early).
 */
function harness(clock: MovableClock, due: Date, leadMs: number, concurrency = 64) {
  const calls: { runId: string; lateMs: number; aborted: boolean }[] = [];
  const queue = testRunQueue({
    clock,
    claimLeadMs: leadMs,
    claimGraceMs: 10_000,
    concurrency,
    claim: async (request) => ({
      kind: 'claimed',
      run: { ...fakeClaimedRun(request.runId), notBefore: due, startPending: true },
    }),
    run: async (run, signal, _left, callEnded) => {
      calls.push({ runId: run.id, lateMs: clock.now() - run.notBefore.getTime(), aborted: signal.aborted });
      callEnded(false);
    },
  });
  return { queue, calls };
}

test('runs claimed ahead for one instant wait on one timer and are called at it, in the order they were claimed', async () => {
  const clock = new MovableClock();
  const due = new Date(Math.trunc(clock.now()) + 150);
  const { queue, calls } = harness(clock, due, 1_000);
  const runs = Array.from({ length: 50 }, (_, i) => id(i + 1));
  for (const runId of runs) queue.hold(announce(runId, due));
  await until(
    () => dueWaits(queue).get(due.getTime())?.waiters.size === runs.length,
    'all 50 claimed, waiting',
  );
  assert.equal(dueWaits(queue).size, 1, 'one timer for the instant');
  assert.equal(calls.length, 0, 'nothing called before its instant');
  await until(() => calls.length === runs.length, 'all 50 called');
  for (const call of calls) assert.ok(call.lateMs >= 0, `${call.runId} called ${-call.lateMs} ms early`);
  assert.deepEqual(
    calls.map((c) => c.runId),
    runs,
    'called in the order claimed',
  );
  assert.equal(dueWaits(queue).size, 0, 'the instant is gone once it came');
  await queue.drain(100, new Error('test over'));
});

test('a re-sync moving the clock estimate back while runs wait: the timer fires early by it, and they wait again', async () => {
  const clock = new MovableClock();
  const due = new Date(Math.trunc(clock.now()) + 150);
  const { queue, calls } = harness(clock, due, 1_000);
  queue.hold(announce(id(1), due));
  queue.hold(announce(id(2), due));
  await until(() => dueWaits(queue).get(due.getTime())?.waiters.size === 2, 'both claimed, waiting');
  const first = dueWaits(queue).get(due.getTime())!.timer;
  clock.shiftMs = -100; // by the new estimate the timer fires 100 ms before the instant
  await until(() => !alive(first), 'the first timer fired');
  assert.equal(calls.length, 0, 'not called at the old estimate');
  assert.equal(dueWaits(queue).get(due.getTime())?.waiters.size, 2, 'both wait again, together');
  await until(() => calls.length === 2, 'both called');
  for (const call of calls) assert.ok(call.lateMs >= 0, `${call.runId} called ${-call.lateMs} ms early`);
  await queue.drain(100, new Error('test over'));
});

test('a run claimed sooner than the timer of its instant by a moved-forward estimate moves the timer earlier', async () => {
  const clock = new MovableClock();
  const due = new Date(Math.trunc(clock.now()) + 400);
  const { queue, calls } = harness(clock, due, 1_000);
  queue.hold(announce(id(1), due));
  await until(() => dueWaits(queue).get(due.getTime())?.waiters.size === 1, 'run 1 waiting');
  clock.shiftMs = 300; // by the new estimate the instant is 300 ms sooner
  const claimedAt = performance.now();
  queue.hold(announce(id(2), due));
  await until(() => calls.length === 2, 'both called');
  const waitedMs = performance.now() - claimedAt;
  assert.ok(waitedMs < 250, `waited ${Math.round(waitedMs)} ms: the old timer (≈400 ms) was kept`);
  for (const call of calls) assert.ok(call.lateMs >= 0, `${call.runId} called ${-call.lateMs} ms early`);
  await queue.drain(100, new Error('test over'));
});

test('a drain ends the wait of runs claimed ahead at once: no call, and no timer left for their instant', async () => {
  const clock = new MovableClock();
  const due = new Date(Math.trunc(clock.now()) + 60_000);
  const { queue, calls } = harness(clock, due, 120_000);
  queue.hold(announce(id(1), due));
  queue.hold(announce(id(2), due));
  await until(() => dueWaits(queue).get(due.getTime())?.waiters.size === 2, 'both claimed, waiting');
  const timer = dueWaits(queue).get(due.getTime())!.timer;
  const started = performance.now();
  await queue.drain(50, new Error('stopping'));
  assert.ok(performance.now() - started < 5_000, 'the drain waited for the instant');
  // Aborted, each went on to run(), which hands an aborted run back without a call (attempt.ts).
  assert.deepEqual(
    calls.map((c) => c.aborted),
    [true, true],
  );
  assert.equal(dueWaits(queue).size, 0);
  assert.ok(!alive(timer), 'the instant’s timer was cleared with its last waiter');
});

test('a run joining an instant already past by a moved-forward estimate releases the runs waiting for it first', async () => {
  const clock = new MovableClock();
  const due = new Date(Math.trunc(clock.now()) + 600);
  const { queue, calls } = harness(clock, due, 1_000);
  queue.hold(announce(id(1), due));
  await until(() => dueWaits(queue).get(due.getTime())?.waiters.size === 1, 'run 1 waiting');
  clock.shiftMs = 700; // by the new estimate the instant is past
  queue.hold(announce(id(2), due));
  await until(() => calls.length === 2, 'both called', 2_000);
  assert.deepEqual(
    calls.map((c) => c.runId),
    [id(1), id(2)],
    'run 1 was left on the timer of the old estimate',
  );
  assert.equal(dueWaits(queue).size, 0);
  await queue.drain(100, new Error('test over'));
});

test('a re-sync moving the estimate back while a due run waits for a slot: its call still waits for not_before', async () => {
  const clock = new MovableClock();
  const first = new Date(Math.trunc(clock.now()) - 1);
  const due = new Date(Math.trunc(clock.now()) + 60);
  const calls: { runId: string; lateMs: number }[] = [];
  let endFirst = () => undefined as void;
  const queue = testRunQueue({
    clock,
    claimLeadMs: 1_000,
    claimGraceMs: 10_000,
    concurrency: 1,
    claim: async (request) => ({
      kind: 'claimed',
      run: {
        ...fakeClaimedRun(request.runId),
        notBefore: request.notBefore,
        startPending: request.notBefore > new Date(),
      },
    }),
    run: async (run, _signal, _left, callEnded) => {
      calls.push({ runId: run.id, lateMs: clock.now() - run.notBefore.getTime() });
      if (run.id === id(1)) await new Promise<void>((resolve) => (endFirst = resolve));
      callEnded();
    },
  });
  queue.hold(announce(id(1), first)); // takes the only slot and keeps it
  await until(() => calls.length === 1, 'run 1 calling');
  queue.hold(announce(id(2), due));
  const waiters = () => (queue as unknown as { slotWaiters: { length: number } }).slotWaiters.length;
  await until(() => waiters() === 1, 'run 2 due, waiting for the slot');
  clock.shiftMs = -300; // by the new estimate run 2 is due in ≈300 ms again
  endFirst();
  await until(() => calls.length === 2, 'run 2 called');
  assert.ok(calls[1]!.lateMs >= 0, `run 2 called ${-calls[1]!.lateMs} ms before its not_before`);
  await queue.drain(100, new Error('test over'));
});
