import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { RunQueue, type RunQueueOptions } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { gate, setCallTime, testRunQueue } from '../support/run-queue.js';

// Claims run ahead of the execution slots (run-queue.ts): a claimed run takes a slot only when it
// is due and one is free, and runs are claimed beyond the free slots only as many as the slots
// start within half the claim grace at the recent call time. These tests set that call time to
// 50 ms, as a node that has been calling fast targets has it; a node that has timed no call yet
// assumes half the grace (the last test).

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

function message(runId: string): RunMessage {
  return { runId, jobId: runId, attempt: 1, scheduledFor: new Date(), notBefore: new Date() };
}

interface Recorder {
  claimed: string[];
  /** Runs whose call was made (the signal not aborted when run() was called). */
  called: string[];
  /** Runs given to run() with an aborted signal: attempt.ts makes no call for those. */
  notCalled: { runId: string; reason: unknown; drainLeftMs?: number }[];
  inFlight: number;
  maxInFlight: number;
}

function makeQueue(
  overrides: Partial<RunQueueOptions>,
  calls: { open: () => void }[] = [],
): { queue: RunQueue; seen: Recorder } {
  const seen: Recorder = { claimed: [], called: [], notCalled: [], inFlight: 0, maxInFlight: 0 };
  const queue = testRunQueue({
    claim: async (request) => {
      seen.claimed.push(request.runId);
      return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
    },
    claimGraceMs: 10_000,
    run: async (run, signal, drainLeftMs, callEnded) => {
      if (signal.aborted) {
        seen.notCalled.push({ runId: run.id, reason: signal.reason, drainLeftMs: drainLeftMs?.() });
        callEnded();
        return;
      }
      seen.called.push(run.id);
      seen.inFlight += 1;
      seen.maxInFlight = Math.max(seen.maxInFlight, seen.inFlight);
      const call = gate();
      calls.push(call);
      await Promise.race([call.promise, new Promise((resolve) => signal.addEventListener('abort', resolve))]);
      seen.inFlight -= 1;
      callEnded();
    },
    ...overrides,
  });
  setCallTime(queue, 50); // a node that has timed many calls
  return { queue, seen };
}

test('runs due at once are claimed ahead of the free slots, and at most `concurrency` calls are made at once', async () => {
  const calls: { open: () => void }[] = [];
  const { queue, seen } = makeQueue({ concurrency: 2, claimGraceMs: 10_000 }, calls);
  for (let n = 1; n <= 20; n++) queue.hold(message(id(n)));
  await sleep(30);
  // 2 × 5,000 / 50 = 200 may wait for a slot: all 20 are claimed while the first 2 calls hang.
  assert.equal(seen.claimed.length, 20);
  assert.deepEqual(seen.called, [id(1), id(2)]);
  assert.equal(queue.freeSlots(), 0, 'claimed runs waiting for a slot leave none to the poller');
  while (seen.called.length < 20 || calls.length > 0) {
    calls.shift()?.open();
    await sleep(1);
  }
  assert.equal(seen.maxInFlight, 2);
  // Slots went to the claimed runs in the order they fell due.
  assert.deepEqual(
    seen.called,
    Array.from({ length: 20 }, (_, i) => id(i + 1)),
  );
  await queue.drain(1_000, new Error('test over'));
  assert.equal(queue.freeSlots(), 0, 'a drained queue takes nothing');
});

test('beyond the free slots, only as many runs are claimed as the slots start within half the grace', async () => {
  const calls: { open: () => void }[] = [];
  // 2 slots × (200 ms / 2) / 50 ms = 4 runs may wait for a slot, plus one per free slot.
  const { queue, seen } = makeQueue({ concurrency: 2, claimGraceMs: 200 }, calls);
  for (let n = 1; n <= 10; n++) queue.hold(message(id(n)));
  await sleep(30);
  assert.equal(seen.claimed.length, 6);
  assert.equal(seen.called.length, 2);
  // Without grace to spare, a run is claimed only for a free slot (as before claims ran ahead).
  const strict = makeQueue({ concurrency: 2, claimGraceMs: 0 }, calls);
  for (let n = 11; n <= 20; n++) strict.queue.hold(message(id(n)));
  await sleep(30);
  assert.equal(strict.seen.claimed.length, 2);
  for (const call of calls.splice(0)) call.open();
  await Promise.all([queue.drain(100, new Error('over')), strict.queue.drain(100, new Error('over'))]);
});

test('a claimed run whose claim is lost while it waits for a slot makes no call, and its place is freed', async () => {
  const calls: { open: () => void }[] = [];
  const { queue, seen } = makeQueue({ concurrency: 1 }, calls);
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await sleep(20);
  assert.deepEqual(seen.called, [id(1)]);
  // The claim watch sees every claim, waiting ones included, and aborts run 2's.
  const watched = [...queue.claims()].map((claim) => claim.runId);
  assert.deepEqual(watched.sort(), [id(1), id(2), id(3)]);
  const lost = [...queue.claims()].find((claim) => claim.runId === id(2))!;
  lost.controller.abort(new Error('claim lost'));
  await sleep(5);
  assert.deepEqual(
    seen.notCalled.map((n) => n.runId),
    [id(2)],
  );
  calls.shift()!.open();
  await sleep(10);
  assert.deepEqual(seen.called, [id(1), id(3)]);
  calls.shift()!.open();
  await sleep(5);
  assert.equal(queue.freeSlots(), 1);
  const counts = queue as unknown as { slotted: number; ahead: number; settling: number };
  assert.deepEqual([counts.slotted, counts.ahead, counts.settling], [0, 0, 0]);
  await queue.drain(1_000, new Error('test over'));
});

test('a drain hands claimed runs waiting for a slot to run() aborted, without a call: at its start when their calls could not end before its deadline, else at the deadline', async () => {
  for (const [timeoutMs, atStart] of [
    [5_000, true],
    [10, false],
  ] as const) {
    const { queue, seen } = makeQueue({
      concurrency: 1,
      claim: async (request) => ({
        kind: 'claimed',
        run: { ...fakeClaimedRun(request.runId, request.attempt), timeoutMs },
      }),
    });
    for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
    await sleep(20);
    const stop = new Error('stopping');
    await queue.drain(100, stop); // run 1's call never ends by itself
    assert.deepEqual(seen.called, [id(1)]);
    assert.deepEqual(seen.notCalled.map((n) => n.runId).sort(), [id(2), id(3)]);
    for (const n of seen.notCalled) {
      assert.equal(n.reason, stop);
      const left = n.drainLeftMs!;
      assert.ok(atStart ? left > 50 : left <= 0, `timeout ${timeoutMs}: ${left} ms of the drain left`);
    }
  }
});

test('a node that has timed no call yet assumes 50 ms a call: 2 × 5,000 / 50 = 200 may wait', async () => {
  const fresh = testRunQueue({ claimGraceMs: 10_000, run: async () => undefined });
  const internals = fresh as unknown as { callMs: number; callsTimed: number; claimBudget: () => number };
  assert.deepEqual([internals.callMs, internals.callsTimed], [50, 0]);
  assert.equal(internals.claimBudget(), 2 + 200);
  await fresh.drain(10, new Error('test over'));
});

test('the first calls timed replace the guess: a node that guessed slow calls claims ahead after one round of fast ones', async () => {
  const calls: { open: () => void }[] = [];
  const { queue, seen } = makeQueue({ concurrency: 2, claimGraceMs: 10_000 }, calls);
  setCallTime(queue, 5_000, 0); // a node that has timed no call, with a guess of 5 s
  for (let n = 1; n <= 100; n++) queue.hold(message(id(n)));
  await sleep(20);
  assert.equal(seen.claimed.length, 4);
  await sleep(10); // the first two calls take ~10 ms
  calls.shift()!.open();
  calls.shift()!.open();
  await sleep(20);
  // ≈10 ms a call: 2 × 5,000 / 10 = 1,000 may wait, so every held run is claimed.
  assert.equal(seen.claimed.length, 100);
  const estimate = (queue as unknown as { callMs: number }).callMs;
  assert.ok(estimate < 100, `call time estimate ${estimate} ms`);
  while (calls.length > 0 || seen.called.length < 100) {
    calls.shift()?.open();
    await sleep(1);
  }
  await queue.drain(100, new Error('test over'));
});
