import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { ClaimLostError } from '../../src/errors.js';
import { startPasses } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/model.js';
import { attemptPlayingQueue, dueAnnouncement, until } from '../support/run-queue.js';

// A run whose signal aborts while it waits for a slot or a start pass (run-queue.ts, slotFor and
// startPassFor) must leave that wait's queue. Left in it, a later grant goes to an execution that
// has already ended: the slot or pass it takes is never given back, and the runs behind it are
// never called. Each test lets the aborted executions END before a slot or pass is freed: a grant
// in the same tick as the abort goes to an execution still winding down, which gives it back, and
// hides the leak (why the tests of those aborts did not fail without the removal).
// Fakes: `run` plays attempt.ts (START unless aborted, then the slot, then the call unless
// aborted), calls held open until the test ends them.

const START_MS = 5;
const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

/** Run `n`'s first announcement, due now, with a call timeout of `timeoutMs`. */
const due = (n: number, timeoutMs = 1000): RunMessage => ({ ...dueAnnouncement(id(n)), timeoutMs });

/** One slot; every run claimed ahead (it takes a start pass) when `startPending`, else once due. */
const oneSlotQueue = (startPending: boolean) =>
  attemptPlayingQueue({ concurrency: 1, startMs: START_MS, startPending: () => startPending });

test('runs waiting for a slot whose claims are lost end uncalled, and the runs behind them get the slot', async () => {
  const { queue, called, notCalled, endCalls } = oneSlotQueue(false);
  for (let n = 1; n <= 6; n++) queue.hold(due(n));
  await until(() => called.length === 1 && [...queue.claims()].length === 6, 'one call, five waiting');
  // The claim watch finds the claims of three of the waiting runs lost (deleted, taken over).
  const waiting = [...queue.claims()].filter((c) => c.runId !== called[0]);
  const lost = waiting.slice(0, 3).map((c) => c.runId);
  const kept = waiting.slice(3).map((c) => c.runId);
  for (const claim of waiting.slice(0, 3)) {
    claim.controller.abort(new ClaimLostError(`run ${claim.runId} is deleted`, false));
  }
  // Their executions end (handed back uncalled) while the call in flight still holds the slot.
  await until(() => [...queue.claims()].every((c) => !lost.includes(c.runId)), 'the lost runs ended');
  await sleep(5);
  assert.equal(called.length, 1);
  await endCalls(1 + kept.length);
  assert.deepEqual(called.slice(1), kept, 'every run whose claim held called, in the order they waited');
  assert.deepEqual([...notCalled].sort(), [...lost].sort(), 'no run whose claim was lost called');
  await until(() => queue.freeSlots() === 1, 'the slot free again', 500);
  assert.equal(queue.callsUnderway(), false);
  await queue.drain(100, new Error('test over'));
});

test('a drain aborting runs waiting for a start pass (calls too long for its deadline): the runs it keeps still get passes and are called', async () => {
  const passes = startPasses(1);
  const { queue, started, called, notCalled, endCalls } = oneSlotQueue(true);
  // A pass for each of runs 1–8 (run 1 gives its back for the slot); runs 9–16, whose calls could
  // not end before the drain's deadline, and run 17, whose call could, wait for a pass.
  const long = Array.from({ length: passes }, (_, i) => id(passes + 1 + i));
  const last = id(2 * passes + 1);
  for (let n = 1; n <= passes; n++) queue.hold(due(n, 100));
  for (let n = passes + 1; n <= 2 * passes; n++) queue.hold(due(n, 60_000));
  queue.hold(due(2 * passes + 1, 100));
  await until(() => called.length === 1 && started.length === passes, 'one call, the passes out');
  await sleep(START_MS * 2);
  const began = performance.now();
  const drained = queue.drain(2_000, new Error('stopping'));
  // The long runs end their wait for a pass, uncalled, before any pass comes back.
  await until(() => notCalled.length === passes, 'the long runs aborted');
  await sleep(5);
  assert.deepEqual([...notCalled].sort(), long);
  try {
    await endCalls(passes + 1);
  } finally {
    await drained;
  }
  assert.ok(performance.now() - began < 1_000, 'the drain ended once its calls had, before its deadline');
  assert.deepEqual([...called].sort(), [...Array.from({ length: passes }, (_, i) => id(i + 1)), last].sort());
  assert.ok(
    called.every((runId) => !long.includes(runId)),
    'no aborted run called',
  );
});
