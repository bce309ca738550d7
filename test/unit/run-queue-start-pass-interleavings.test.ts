import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { ClaimLostError } from '../../src/errors.js';
import { startPasses, type RunQueue } from '../../src/execution/run-queue.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import {
  attemptPlayingQueue,
  dueAnnouncement as due,
  queueCounters,
  startPassCounts,
  until,
} from '../support/run-queue.js';

// Start passes (run-queue.ts) against the other ways an execution ends without its slot: the
// poller's claim of the same run (superseded), the claim watch, a drain aborting runs that wait for
// a pass. Each must give its pass back (or never take one), or the passes given out in blocks (once
// no more than half are held) never come back and every later run claimed ahead waits for ever.
// Fakes: `run` plays attempt.ts, START a round trip of START_MS, calls open until the test ends them.

const START_MS = 20;
const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

/** One slot; every run claimed ahead (startPending) and due now; calls held open until ended. */
const startingQueue = () =>
  attemptPlayingQueue({ concurrency: 1, startMs: START_MS, startPending: () => true });

/** Nothing left held, waiting or counted once every execution has ended. */
async function assertSettled(queue: RunQueue): Promise<void> {
  await until(() => queueCounters(queue).executing === 0, 'every execution ended');
  assert.deepEqual(startPassCounts(queue), { held: 0, waiting: 0 }, 'start passes all back');
  const c = queueCounters(queue);
  assert.deepEqual(
    { slotted: c.slotted, ahead: c.ahead, superseded: c.superseded, backlogCalls: c.backlogCalls },
    { slotted: 0, ahead: 0, superseded: 0, backlogCalls: 0 },
  );
  assert.equal(queue.callsUnderway(), false, 'no calls underway once all ended');
}

test("runs holding a pass that the poller's claim of the same run supersedes give their passes back", async () => {
  const n = startPasses(1) + 3;
  const { queue, started, called, endCalls } = startingQueue();
  for (let i = 1; i <= n; i++) queue.hold(due(id(i)));
  await until(() => called.length === 1 && started.length === startPasses(1), 'one call, the passes out');
  await sleep(START_MS * 2);
  // Seven runs marked started wait for the slot; three wait for a pass (more than half are held).
  assert.deepEqual(startPassCounts(queue), { held: startPasses(1) - 1, waiting: 3 });
  // Their claims expired and were taken back; the poller claimed four of them again on this node.
  const release = queue.reserve(4);
  for (let i = 2; i <= 5; i++) queue.execute(fakeClaimedRun(id(i), 2));
  release();
  await endCalls(n);
  await assertSettled(queue);
  // Each run called once: the four by the poller's claim (attempt 2), none by the superseded one.
  assert.deepEqual([...called].sort(), Array.from({ length: n }, (_, i) => id(i + 1)).sort());
  await queue.drain(100, new Error('test over'));
});

test('runs holding a pass whose claim the claim watch finds lost give their passes back, uncalled', async () => {
  const n = startPasses(1) + 3;
  const { queue, started, called, endCalls } = startingQueue();
  for (let i = 1; i <= n; i++) queue.hold(due(id(i)));
  await until(() => called.length === 1 && started.length === startPasses(1), 'one call, the passes out');
  await sleep(START_MS * 2);
  // The watch sees the runs holding passes (marked started, waiting for the slot) and aborts five.
  const watched = [...queue.claims()];
  const lost = watched.filter((c) => c.runId !== called[0]).slice(0, 5);
  assert.equal(lost.length, 5, `watched: ${watched.length}`);
  for (const c of lost) c.controller.abort(new ClaimLostError(`run ${c.runId} is deleted`, false));
  await endCalls(n - lost.length);
  await assertSettled(queue);
  const lostIds = new Set(lost.map((c) => c.runId));
  assert.ok(
    called.every((runId) => !lostIds.has(runId)),
    'no run whose claim was lost is called',
  );
  assert.equal(called.length, n - lost.length, 'every other run called once');
  assert.equal(new Set(called).size, called.length);
  await queue.drain(100, new Error('test over'));
});

test('a drain aborts runs waiting for a pass: they take none and are not marked started', async () => {
  const n = startPasses(1) + 3;
  const { queue, started, called, open } = startingQueue();
  for (let i = 1; i <= n; i++) queue.hold(due(id(i)));
  await until(
    () => called.length === 1 && startPassCounts(queue).waiting === 3,
    'one call, three waiting for a pass',
  );
  // The calls (1 s timeout) cannot end before a 200 ms deadline: all but the call in flight aborted.
  const drained = queue.drain(200, new Error('stopping'));
  await until(
    () => startPassCounts(queue).waiting === 0,
    'the runs waiting for a pass ended their wait',
    100,
  );
  open.shift()!();
  await drained;
  await assertSettled(queue);
  assert.equal(started.length, startPasses(1), 'no START for a run aborted while it waited for a pass');
  assert.deepEqual(called, [id(1)]);
});
