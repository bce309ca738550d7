import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { startPasses, type RunQueue, type RunQueueOptions } from '../../src/execution/run-queue.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { dueAnnouncement as due, gate, setCallTime, testRunQueue, until } from '../support/run-queue.js';

// Start passes (run-queue.ts): a run claimed ahead is marked started (START) while it waits for
// its slot, not after it got one, so a slot a call gives back goes to a run ready to call; and at
// most startPasses(concurrency) runs are marked started without a slot, given out in blocks so
// that their STARTs go together. Fakes: `run` plays attempt.ts, its START a round trip of
// START_MS, its call open until the test ends it.

const START_MS = 60;
const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

interface Seen {
  /** performance.now() when each run's START was sent, and when its call began. */
  starts: Map<string, number>;
  calls: Map<string, number>;
  /** Runs marked started (START answered) whose call has not begun: the most there were at once. */
  startedWithoutSlot: number;
  mostStartedWithoutSlot: number;
  /** Calls open, ended by the test (first come first ended). */
  open: { runId: string; end: () => void }[];
}

/** A queue whose runs are all claimed ahead (startPending) and due now; `concurrency` slots. */
function startingQueue(concurrency: number, overrides: Partial<RunQueueOptions> = {}) {
  const seen: Seen = {
    starts: new Map(),
    calls: new Map(),
    startedWithoutSlot: 0,
    mostStartedWithoutSlot: 0,
    open: [],
  };
  const queue: RunQueue = testRunQueue(
    {
      concurrency,
      claimGraceMs: 10_000,
      claim: async (request) => ({
        kind: 'claimed',
        run: { ...fakeClaimedRun(request.runId), startPending: true },
      }),
      run: async (run, signal, _left, callEnded, untilSlot) => {
        // attempt.ts: START first (a round trip), then the slot, then the call.
        seen.starts.set(run.id, performance.now());
        await sleep(START_MS);
        seen.startedWithoutSlot += 1;
        seen.mostStartedWithoutSlot = Math.max(seen.mostStartedWithoutSlot, seen.startedWithoutSlot);
        await untilSlot();
        seen.startedWithoutSlot -= 1;
        if (signal.aborted) return callEnded(false);
        seen.calls.set(run.id, performance.now());
        const call = gate();
        seen.open.push({ runId: run.id, end: call.open });
        await call.promise;
        callEnded(true);
      },
      ...overrides,
    },
    { slotFirst: false },
  );
  setCallTime(queue, 50);
  return { queue, seen };
}

/** Ends the oldest open call. */
function endOne(seen: Seen): string {
  const call = seen.open.shift();
  assert.ok(call, 'a call to end');
  call.end();
  return call.runId;
}

test('a slot a call gives back goes to a run already marked started: its call does not wait for a START', async () => {
  const { queue, seen } = startingQueue(2);
  const now = new Date();
  for (let n = 1; n <= 6; n++) queue.hold(due(id(n), now));
  await until(() => seen.calls.size === 2, 'the first two calls');
  // The other four were marked started meanwhile, waiting for a slot.
  await until(() => seen.startedWithoutSlot === 4, 'four runs marked started, waiting for a slot');
  for (let n = 3; n <= 6; n++) {
    const ended = performance.now();
    endOne(seen);
    await until(() => seen.calls.size === n, `call ${n}`);
    const waited = seen.calls.get(id(n))! - ended;
    assert.ok(waited < START_MS / 2, `call ${n} began ${waited.toFixed(1)} ms after a slot was given back`);
  }
  while (seen.open.length > 0) endOne(seen);
  await until(() => seen.open.length === 0 && seen.calls.size === 6, 'all called');
  await queue.drain(100, new Error('test over'));
});

test('runs marked started without a slot are at most the start passes, given out in blocks', async () => {
  const concurrency = 2;
  const passes = startPasses(concurrency);
  assert.ok(passes >= 4, `passes ${passes}`);
  const { queue, seen } = startingQueue(concurrency);
  const now = new Date();
  const runs = passes * 3;
  for (let n = 1; n <= runs; n++) queue.hold(due(id(n), now));
  await until(() => seen.calls.size === concurrency, 'the first calls');
  await sleep(START_MS * 2);
  // The slots took two passes back: no block yet (more than half are held).
  assert.equal(seen.starts.size, passes, 'as many STARTs as passes at first');
  // Ending calls gives slots to runs holding passes; once only half the passes are held, a
  // block of STARTs goes at once, up to the limit again.
  const startsAt: number[] = [];
  while (seen.calls.size < runs) {
    const before = seen.starts.size;
    endOne(seen);
    await until(() => seen.open.length === concurrency || seen.calls.size === runs, 'the next call');
    if (seen.starts.size > before) startsAt.push(seen.starts.size - before);
  }
  assert.ok(
    seen.mostStartedWithoutSlot <= passes,
    `${seen.mostStartedWithoutSlot} marked started without a slot`,
  );
  assert.equal(seen.starts.size, runs, 'every run started once');
  // Blocks of half the passes (the last one may be smaller): not one START per slot given back.
  assert.ok(
    startsAt.slice(0, -1).every((block) => block >= passes / 2),
    `STARTs given out in blocks: ${startsAt.join(', ')}`,
  );
  while (seen.open.length > 0) endOne(seen);
  await queue.drain(100, new Error('test over'));
});

test('runs waiting for a start pass are calls underway, though no slot is taken yet', async () => {
  const concurrency = 2;
  const passes = startPasses(concurrency);
  const { queue, seen } = startingQueue(concurrency);
  const now = new Date();
  for (let n = 1; n <= passes + 3; n++) queue.hold(due(id(n), now));
  // Every pass is held by a run whose START is on its way: no call yet, three runs wait for a pass.
  await until(() => seen.starts.size === passes, 'the passes given out');
  assert.equal(seen.calls.size, 0);
  assert.equal(queue.callsUnderway(), true, 'writes held for the herd stay held');
  await until(() => seen.calls.size === concurrency, 'the first calls');
  while (seen.calls.size < passes + 3 || seen.open.length > 0) {
    if (seen.open.length > 0) endOne(seen);
    await sleep(2);
  }
  await until(() => !queue.callsUnderway(), 'the herd over');
  await queue.drain(100, new Error('test over'));
});

test('a drain aborts the runs holding a pass whose call could not end before its deadline: no call, their STARTs done or not', async () => {
  const { queue, seen } = startingQueue(1);
  const now = new Date();
  for (let n = 1; n <= 3; n++) queue.hold(due(id(n), now));
  await until(() => seen.calls.size === 1, 'the first call');
  await until(() => seen.startedWithoutSlot === 2, 'two marked started, waiting for the slot');
  // The calls' timeout (1 s) could not end before a 300 ms deadline: the two waiting are aborted
  // at the drain's start; the call in flight is left to end.
  const drained = queue.drain(300, new Error('stopping'));
  await sleep(20);
  assert.equal(seen.startedWithoutSlot, 0, 'the waiting runs ended their wait');
  endOne(seen);
  await drained;
  assert.deepEqual([...seen.calls.keys()], [id(1)], 'only the call in flight was made');
});

test('runs waiting for a start pass count as waiting for calls in the pace that bounds the claims ahead', async () => {
  // Every pass held by a run whose START is still on its way: no run waits for a slot, but the
  // node starts no call meanwhile, and its claims ahead must follow that pace, not the call time.
  const concurrency = 2;
  const passes = startPasses(concurrency);
  const startGate = gate();
  const { queue, seen } = startingQueue(concurrency, {
    run: async (run, signal, _left, callEnded, untilSlot) => {
      seen.starts.set(run.id, performance.now());
      await startGate.promise;
      await untilSlot();
      if (signal.aborted) return callEnded(false);
      callEnded(true);
    },
  });
  const now = new Date();
  for (let n = 1; n <= passes + 4; n++) queue.hold(due(id(n), now));
  await until(() => seen.starts.size === passes, 'the passes given out');
  const pace = () => (queue as unknown as { saturatedPace?: number }).saturatedPace;
  // The pace is sampled when the queue is pumped (a run announced, a call ended), over windows of
  // 250 ms during which runs waited throughout: two announcements 300 ms apart, no slot given.
  await sleep(300);
  queue.hold(due(id(passes + 5), now));
  await sleep(300);
  queue.hold(due(id(passes + 6), now));
  assert.equal(seen.calls.size, 0);
  assert.equal(pace(), 0, 'the pace measured while runs waited for a pass');
  startGate.open();
  await until(() => seen.starts.size === passes + 6, 'all started');
  await queue.drain(1_000, new Error('test over'));
});

test('runs claimed once due wait for a pass behind the runs claimed ahead before them: none overtakes them to a slot', async () => {
  // A run claimed once due (overdue under a backlog, a forbid or replace run) needs no START, but
  // took its slot without a pass: it went to the slots ahead of runs claimed before it that still
  // waited for one. Under a backlog those waited past their claims' grace and were handed back by
  // the block (offered 4,000 runs/s on the benchmark's 3 nodes: ≈1,000 `claim-too-late`).
  const claimedAhead = 3 * startPasses(1); // more than the passes: some wait for one
  const { queue, seen } = startingQueue(1, {
    claim: async (request) => ({
      kind: 'claimed',
      run: {
        ...fakeClaimedRun(request.runId),
        startPending: Number(request.runId.slice(-4)) <= claimedAhead,
      },
    }),
    run: async (run, signal, _left, callEnded, untilSlot) => {
      // attempt.ts: a run claimed ahead is marked started (a round trip), then waits for its slot;
      // the others hold their slot already.
      if (run.startPending) {
        seen.starts.set(run.id, performance.now());
        await sleep(5);
      }
      await untilSlot();
      if (signal.aborted) return callEnded(false);
      seen.calls.set(run.id, performance.now());
      const call = gate();
      seen.open.push({ runId: run.id, end: call.open });
      await call.promise;
      callEnded(true);
    },
  });
  const now = new Date();
  for (let n = 1; n <= claimedAhead; n++) queue.hold(due(id(n), now));
  await until(() => seen.starts.size === startPasses(1) && seen.calls.size === 1, 'the first block started');
  const late = [1001, 1002, 1003].map(id);
  for (const runId of late) queue.hold(due(runId, now));
  const order: string[] = [];
  while (order.length < claimedAhead + late.length) {
    await until(() => seen.open.length > 0, `call ${order.length + 1}`);
    order.push(endOne(seen));
  }
  const firstLate = order.findIndex((runId) => late.includes(runId));
  assert.equal(
    firstLate,
    claimedAhead,
    `a run claimed once due was called ${claimedAhead - firstLate} calls early`,
  );
  await queue.drain(1_000, new Error('test over'));
});

test('slots runs take at once after their START count in the pace, as slots given to waiting runs do', async () => {
  // Runs wait for passes throughout; each block's STARTs come back together and its runs take the
  // slots the calls before them freed, at once (slotFor), none waiting in the slot queue. Counted
  // only when given in pump(), those slots made no pace, and the claims ahead stopped at the free
  // slots while the node called at full speed (a 60 s hold at 5,000 runs/s: ≈3,000/s completed).
  const concurrency = 4;
  const { queue, seen } = startingQueue(concurrency, {
    run: async (run, signal, _left, callEnded, untilSlot) => {
      seen.starts.set(run.id, performance.now());
      await sleep(20); // START
      await untilSlot();
      if (signal.aborted) return callEnded(false);
      seen.calls.set(run.id, performance.now());
      callEnded(true); // a call that ends at once: the next run finds its slot free
    },
  });
  const now = new Date();
  const runs = 60 * startPasses(concurrency); // ≈1 s of blocks: the pace is sampled in 250 ms windows
  for (let n = 1; n <= runs; n++) queue.hold(due(id(n), now));
  const pace = () => (queue as unknown as { saturatedPace?: number }).saturatedPace;
  await until(() => seen.calls.size >= (runs * 3) / 4, 'three quarters of the calls', 10_000);
  const slotsPerMs = seen.calls.size / (performance.now() - Math.min(...seen.calls.values()));
  assert.ok(
    (pace() ?? 0) > slotsPerMs / 4,
    `the pace measured ${pace()} slots per ms, where runs got ${slotsPerMs.toFixed(2)}`,
  );
  await queue.drain(1_000, new Error('test over'));
});
