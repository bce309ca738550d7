import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { MicroBatcher, BatchItemError } from '../../src/execution/micro-batcher.js';
import type { RunQueue, RunQueueOptions } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { setCallTime, testRunQueue, until } from '../support/run-queue.js';

// Review of 9d5d0ea (held completions): the interleavings a reviewer found, each failing on that
// commit. Writes are a MicroBatcher with the worker's wiring (busy = queue.callsUnderway(),
// writesHeld = held, onHold = writesHeldGrew, onCallsCaughtUp = release); maxWaitMs is long
// so that a write that goes only because its hold timer fired shows as a timeout here (in the
// worker the timer is 1 s: the failures below cost up to 1 s, they lose nothing).

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;
function message(runId: string, notBefore = new Date()): RunMessage {
  return { runId, jobId: runId, attempt: 1, scheduledFor: notBefore, notBefore };
}
function gate(): { promise: Promise<void>; open: () => void } {
  let open!: () => void;
  const promise = new Promise<void>((resolve) => (open = resolve));
  return { promise, open };
}
function wired(
  overrides: Partial<RunQueueOptions> & Pick<RunQueueOptions, 'run'>,
  written: string[][],
): { queue: RunQueue; writes: MicroBatcher<string, boolean> } {
  const writes: MicroBatcher<string, boolean> = new MicroBatcher<string, boolean>(
    async (ids) => {
      written.push(ids);
      return ids.map(() => true);
    },
    100,
    2,
    {
      busy: () => queue.callsUnderway(),
      maxWaitMs: 60_000,
      maxWaiting: 1000,
      onHold: () => queue.writesHeldGrew(),
    },
  );
  const queue: RunQueue = testRunQueue({
    writesHeld: () => writes.held,
    onCallsCaughtUp: () => writes.release(),
    ...overrides,
  });
  return { queue, writes };
}

test('review 2/4: a write held after a run began waiting for a slot without update() goes once that run has its slot', async () => {
  // Run 1: call over, its write retried later (whileClaimed after a failed batch). Run 2: a long
  // call. Run 3: due later, claimed, waits for the slot: slotFor() pushes it with no update(), so
  // wasWaiting stays false and the queue never sees callsUnderway() turn true -> false.
  const written: string[][] = [];
  const retry = gate();
  const long = gate();
  let run3Started = false;
  const { queue, writes } = wired(
    {
      concurrency: 1,
      claimGraceMs: 10_000,
      run: async (run, _s, _l, callEnded) => {
        if (run.id === id(2)) await long.promise;
        if (run.id === id(3)) run3Started = true;
        callEnded();
        if (run.id === id(1)) await retry.promise;
        if (run.id === id(2)) return; // its outcome is not a held success (a failure's write)
        if (run.id === id(3)) return;
        await writes.add(run.id, true);
      },
    },
    written,
  );
  setCallTime(queue, 50);
  queue.hold(message(id(1)));
  queue.hold(message(id(2)));
  queue.hold(message(id(3), new Date(Date.now() + 50)));
  await sleep(150);
  assert.equal(queue.callsUnderway(), true, 'run 3 waits for a slot');
  retry.open(); // run 1's write, re-added: held (calls wait)
  await until(() => writes.held === 1, 'run 1 write held');
  long.open(); // run 2 ends: run 3 gets the slot, nothing waits any more
  await until(() => run3Started, 'run 3 to start');
  assert.equal(queue.callsUnderway(), false);
  await until(() => written.flat().includes(id(1)), 'run 1 write to go once calls caught up', 500);
});

test('review 4: a drain releases held writes at once (also when wasWaiting is stale)', async () => {
  const written: string[][] = [];
  const retry = gate();
  const long = gate();
  const { queue, writes } = wired(
    {
      concurrency: 1,
      claimGraceMs: 10_000,
      run: async (run, _s, _l, callEnded) => {
        if (run.id === id(2)) await long.promise;
        callEnded();
        if (run.id === id(1)) await retry.promise;
        await writes.add(run.id, true);
      },
    },
    written,
  );
  setCallTime(queue, 50);
  queue.hold(message(id(1)));
  queue.hold(message(id(2)));
  queue.hold(message(id(3), new Date(Date.now() + 50)));
  await sleep(150);
  retry.open();
  await until(() => writes.held === 1, 'run 1 write held');
  const drained = queue.drain(5_000, new Error('test over'));
  try {
    await until(() => written.flat().includes(id(1)), 'held write to go when the drain begins', 500);
  } finally {
    long.open();
    await drained;
  }
});

test('review 3: a slot a held write gives back is granted at once (no pump when writesHeld grows)', async () => {
  // Run 1's outcome write is slow and never held (a failure, a forbid run): it settles beyond
  // nothing. Run 2 ends with settling > concurrency, so it keeps its slot; then its success is
  // added and held, which gives the slot back, but nothing pumps: run 3 (waiting) is stuck until
  // the hold timer fires, and the hold lasts because run 3 waits.
  const written: string[][] = [];
  const slowWrite = gate();
  let run3Started = false;
  const { queue, writes } = wired(
    {
      concurrency: 1,
      run: async (run, _s, _l, callEnded) => {
        if (run.id === id(3)) run3Started = true;
        callEnded();
        if (run.id === id(1)) return slowWrite.promise;
        await writes.add(run.id, true);
      },
    },
    written,
  );
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  try {
    // Without the pump, run 3 waits for the hold timer (60 s here).
    await until(() => run3Started, 'run 3 to get the slot run 2 gave back', 500);
  } finally {
    slowWrite.open();
    await queue.drain(2_000, new Error('test over'));
  }
});

test('review 2/3: random interleavings keep calls <= concurrency and the batcher counters sane', async () => {
  // Writes fail at random (whole batch or one item); the run retries its write as whileClaimed
  // does, sometimes as an urgent item (claim short). Calls take random times.
  let seed = 42;
  const rnd = () => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
  let inCall = 0;
  let maxInCall = 0;
  let done = 0;
  const total = 200;
  const writes: MicroBatcher<string, boolean> = new MicroBatcher<string, boolean>(
    async (ids) => {
      await sleep(Math.floor(rnd() * 5));
      if (rnd() < 0.1) throw new Error('batch failed');
      return ids.map(() => (rnd() < 0.1 ? new BatchItemError(new Error('item failed')) : true));
    },
    8,
    2,
    {
      busy: () => queue.callsUnderway(),
      maxWaitMs: 30,
      maxWaiting: 16,
      onHold: () => queue.writesHeldGrew(),
    },
  );
  const b = writes as unknown as { heldPending: number; heldInFlight: number; pending: unknown[] };
  const queue: RunQueue = testRunQueue({
    concurrency: 3,
    writesHeld: () => {
      assert.ok(b.heldPending >= 0 && b.heldInFlight >= 0, 'held counters not negative');
      assert.ok(b.heldPending <= b.pending.length, 'heldPending within pending');
      const settling = (queue as unknown as { settling: number }).settling;
      assert.ok(writes.held <= settling, `held ${writes.held} <= settling ${settling}`);
      return writes.held;
    },
    onCallsCaughtUp: () => writes.release(),
    run: async (run, _s, _l, callEnded) => {
      inCall += 1;
      maxInCall = Math.max(maxInCall, inCall);
      await sleep(Math.floor(rnd() * 4));
      inCall -= 1;
      callEnded();
      for (;;) {
        try {
          await writes.add(run.id, rnd() < 0.8);
          break;
        } catch {
          await sleep(1);
        }
      }
      done += 1;
    },
  });
  for (let n = 1; n <= total; n++) queue.hold(message(id(n)));
  await until(() => done === total, 'all written', 20_000);
  assert.ok(maxInCall <= 3, `max calls at once ${maxInCall}`);
  assert.equal(writes.held, 0);
  assert.equal(b.pending.length, 0);
  await queue.drain(1_000, new Error('test over'));
});

test('review 3: held writes that complete never let more than `concurrency` calls run (held <= settling when the queue pumps)', async () => {
  let inCall = 0;
  let maxInCall = 0;
  let done = 0;
  let heldOverSettling = 0;
  const total = 40;
  const writes: MicroBatcher<string, boolean> = new MicroBatcher<string, boolean>(
    async (ids) => {
      await sleep(2);
      return ids.map(() => true);
    },
    100,
    2,
    {
      busy: () => queue.callsUnderway(),
      maxWaitMs: 10,
      maxWaiting: 1000,
      onHold: () => queue.writesHeldGrew(),
    },
  );
  const queue: RunQueue = testRunQueue({
    concurrency: 2,
    writesHeld: () => {
      if (writes.held > (queue as unknown as { settling: number }).settling) heldOverSettling += 1;
      return writes.held;
    },
    onCallsCaughtUp: () => writes.release(),
    run: async (run, _s, _l, callEnded) => {
      inCall += 1;
      maxInCall = Math.max(maxInCall, inCall);
      await sleep(15);
      inCall -= 1;
      callEnded();
      await writes.add(run.id, true);
      done += 1;
    },
  });
  for (let n = 1; n <= total; n++) queue.hold(message(id(n)));
  await until(() => done === total, 'all written', 10_000);
  await queue.drain(1_000, new Error('test over'));
  assert.ok(
    maxInCall <= 2,
    `at most 2 calls at once, saw ${maxInCall} (held > settling at ${heldOverSettling} pumps)`,
  );
  assert.equal(heldOverSettling, 0, 'writesHeld() exceeded settling when the queue pumped');
});
