import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { ClaimLostError } from '../../src/errors.js';
import { startPasses, type RunQueue } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/model.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import {
  attemptPlayingQueue,
  dueAnnouncement,
  queueCounters,
  queueWithGatedCalls,
  startPassCounts,
  until,
} from '../support/run-queue.js';

// Runs claimed once due (startPending false: forbid and replace runs, runs overdue under a backlog)
// take a start pass too, then their slot (476ebb2). Each way such a run ends without its call must
// give its pass back; the passes must never leave runs waiting with slots to give.

const START_MS = 10;
const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;
const due = (n: number, timeoutMs = 1000): RunMessage => ({ ...dueAnnouncement(id(n)), timeoutMs });

/** `concurrency` slots; runs with n in `pending` claimed ahead, the others claimed once due. */
const mixedQueue = (concurrency: number, pending: (n: number) => boolean) =>
  attemptPlayingQueue({ concurrency, startMs: START_MS, startPending: pending });

async function assertSettled(queue: RunQueue): Promise<void> {
  await until(() => queueCounters(queue).executing === 0, 'every execution ended');
  assert.deepEqual(startPassCounts(queue), { held: 0, waiting: 0 }, 'start passes all back');
  const c = queueCounters(queue);
  assert.deepEqual(
    {
      slotted: c.slotted,
      ahead: c.ahead,
      superseded: c.superseded,
      backlogCalls: c.backlogCalls,
      slotWaiters: c.slotWaiters,
    },
    { slotted: 0, ahead: 0, superseded: 0, backlogCalls: 0, slotWaiters: 0 },
  );
  assert.equal(queue.callsUnderway(), false, 'no calls underway once all ended');
}

test('runs claimed once due waiting for a pass or a slot are watched, and a lost claim gives the pass back uncalled', async () => {
  const n = startPasses(1) + 4;
  const { queue, called, notCalled, endCalls } = mixedQueue(1, () => false);
  for (let i = 1; i <= n; i++) queue.hold(due(i));
  await until(() => called.length === 1 && startPassCounts(queue).waiting > 0, 'one call, the rest wait');
  const watched = new Set([...queue.claims()].map((c) => c.runId));
  assert.equal(watched.size, n, 'every claimed run (pass holders and pass waiters) watched');
  // Lose the claims of two pass holders waiting for the slot and two runs waiting for a pass.
  const holders = [id(2), id(3)];
  const waiters = [id(n - 1), id(n)];
  for (const c of queue.claims())
    if ([...holders, ...waiters].includes(c.runId)) c.controller.abort(new ClaimLostError('lost'));
  await endCalls(n - 4);
  await assertSettled(queue);
  assert.deepEqual(new Set(notCalled), new Set([...holders, ...waiters]));
  assert.equal(new Set(called).size, n - 4);
});

test("the poller's claim of a run claimed once due that holds a pass supersedes it: pass back, one call", async () => {
  const n = startPasses(1) + 3;
  const { queue, called, endCalls } = mixedQueue(1, (i) => i % 2 === 0);
  for (let i = 1; i <= n; i++) queue.hold(due(i));
  await until(() => called.length === 1 && startPassCounts(queue).waiting > 0, 'one call, the rest wait');
  await sleep(START_MS * 3);
  const release = queue.reserve(3);
  for (const i of [3, 4, n]) queue.execute(fakeClaimedRun(id(i), 2));
  release();
  await endCalls(n);
  await assertSettled(queue);
  assert.equal(called.length, n, 'each run called once');
  assert.equal(new Set(called).size, n);
});

test('one slot, eight passes, runs claimed ahead and once due interleaved, the poller reserving meanwhile: all called, none left', async () => {
  const n = 5 * startPasses(1);
  const { queue, called, endCalls } = mixedQueue(1, (i) => i % 3 !== 0);
  for (let i = 1; i <= n; i++) queue.hold(due(i));
  await until(() => called.length === 1 && startPassCounts(queue).waiting > 0, 'one call, the rest wait');
  // The poller's query holds the slot reserved while every pass is held.
  const release = queue.reserve(1);
  await sleep(30);
  release();
  await endCalls(n);
  await assertSettled(queue);
  assert.equal(new Set(called).size, n);
});

test('a drain: runs claimed once due waiting for a pass whose calls could not end before the deadline are handed back uncalled, the others called', async () => {
  const { queue, called, notCalled, open } = mixedQueue(1, () => false);
  // Run 1 calls; 2..9 short (100 ms) hold passes or wait; 10..12 long (10 s) wait for a pass.
  for (let i = 1; i <= 9; i++) queue.hold(due(i, 100));
  for (let i = 10; i <= 12; i++) queue.hold(due(i, 10_000));
  await until(
    () => called.length === 1 && startPassCounts(queue).waiting === 4,
    'one call, 8 passes held, 4 waiting',
  );
  const drained = queue.drain(2_000, new Error('test over'));
  await until(() => notCalled.length === 3, 'long runs aborted');
  assert.deepEqual(new Set(notCalled), new Set([id(10), id(11), id(12)]));
  const by = performance.now() + 1_500;
  while (called.length < 9 || open.length > 0) {
    assert.ok(performance.now() < by, `${called.length} of 9 short runs called before the deadline`);
    open.shift()?.();
    await sleep(2);
  }
  await drained;
  await assertSettled(queue);
});

test('more than 64 slots (passes capped at 512): runs claimed once due beyond the passes all get slots', async () => {
  const concurrency = 100;
  const n = 1_500;
  const { queue, called, endCalls } = mixedQueue(concurrency, (i) => i % 4 === 0);
  for (let i = 1; i <= n; i++) queue.hold(due(i));
  await until(() => called.length === concurrency, 'the slots full');
  assert.equal(startPassCounts(queue).held <= 512, true);
  await endCalls(n, 10_000);
  await assertSettled(queue);
  assert.equal(new Set(called).size, n);
});

test('held writes: runs claimed once due waiting for a pass keep writes held, and the backlog ends with the last call (no hold timeout)', async () => {
  const n = 3 * startPasses(1);
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 1, claimGraceMs: 10_000 },
    [id(1)],
  );
  try {
    for (let i = 1; i <= n; i++) queue.hold(dueAnnouncement(id(i)));
    await until(
      () => called.size === 1 && startPassCounts(queue).waiting > 0,
      'one call, runs wait for passes',
    );
    assert.equal(queue.callsUnderway(), true);
    open(id(1));
    await until(() => written.flat().length === n, 'every write gone', 2_000);
    assert.equal(queue.callsUnderway(), false);
    await assertSettled(queue);
  } finally {
    openAll();
    await queue.drain(1_000, new Error('test over'));
  }
});

test('a run claimed once due aborted right after its pass was granted, before it asks for a slot: no call, pass back', async () => {
  const { queue, called, notCalled, endCalls } = mixedQueue(1, () => false);
  const n = startPasses(1) + 2;
  for (let i = 1; i <= n; i++) queue.hold(due(i));
  await until(
    () => called.length === 1 && startPassCounts(queue).waiting === 2,
    'one call, two waiting for a pass',
  );
  // Aborted in the same tick its pass is granted (the block grant), before it asks for a slot.
  const waiters = [id(n - 1), id(n)];
  const q = queue as unknown as {
    takeStartPass: (e: { runId: string; controller: AbortController }) => void;
  };
  const take = q.takeStartPass.bind(queue);
  q.takeStartPass = (e) => {
    take(e);
    if (waiters.includes(e.runId)) e.controller.abort(new ClaimLostError('lost'));
  };
  await endCalls(n - 2);
  await assertSettled(queue);
  assert.deepEqual(new Set(notCalled), new Set(waiters));
});

test('600 slots, passes capped at 512, runs claimed ahead and once due: all called, the slots all used', async () => {
  const concurrency = 600;
  const n = 2_000;
  const { queue, called, endCalls } = mixedQueue(concurrency, (i) => i % 2 === 0);
  for (let i = 1; i <= n; i++) queue.hold(due(i));
  await until(() => called.length === concurrency, 'the slots full', 5_000);
  await endCalls(n, 10_000);
  await assertSettled(queue);
  assert.equal(new Set(called).size, n);
});
