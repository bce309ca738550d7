import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { RunQueue, type RunQueueOptions } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import {
  gate,
  queueRecordingWrites,
  queueWithGatedCalls,
  queueWithHeldWrites,
  testRunQueue,
  until,
} from '../support/run-queue.js';

// A run gives its slot back when its call ends (callEnded), while its outcome is still being
// written: the settling accounting under the interleavings that could break it. Claims and
// executions are fakes; `run` plays attempt.ts: the call, callEnded(), then the settle write.

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

function message(runId: string, attempt = 1): RunMessage {
  return { runId, jobId: runId, attempt, scheduledFor: new Date(), notBefore: new Date() };
}

/** The queue's own counters, read for invariants only. */
function internals(queue: RunQueue): { settling: number; executing: number; reserved: number } {
  const q = queue as unknown as { settling: number; executing: Map<string, unknown>; reserved: number };
  return { settling: q.settling, executing: q.executing.size, reserved: q.reserved };
}

function makeQueue(overrides: Partial<RunQueueOptions> & Pick<RunQueueOptions, 'run'>): RunQueue {
  return testRunQueue(overrides);
}

/** Counts calls at the target (started, not yet ended), keeping the highest. */
class Target {
  inFlight = 0;
  max = 0;
  begin(): void {
    this.inFlight += 1;
    this.max = Math.max(this.max, this.inFlight);
  }
  end(): void {
    this.inFlight -= 1;
  }
}

test('(a) callEnded twice, after the execution is gone, and a run that rejects after callEnded leave the count right', async () => {
  const late: (() => void)[] = [];
  const queue = makeQueue({
    concurrency: 2,
    run: async (run, _signal, _left, callEnded) => {
      late.push(callEnded);
      if (run.id === id(5)) return; // never calls it while it runs (a replace run replaced)
      callEnded();
      callEnded(); // twice: counted once
      if (run.id === id(2)) throw new Error('settle blew up'); // "must not reject", but if it does
    },
  });
  for (let n = 1; n <= 5; n++) queue.hold(message(id(n)));
  await sleep(30);
  for (const callEnded of late) callEnded(); // after the executions left `executing`
  assert.deepEqual(internals(queue), { settling: 0, executing: 0, reserved: 0 });
  assert.equal(queue.freeSlots(), 2);
  await queue.drain(100, new Error('test over'));
});

test('(a) callEnded synchronously inside execute() (the poller path, a call not made) is counted once and undone', async () => {
  const settle = gate();
  const queue = makeQueue({
    concurrency: 2,
    run: async (_run, _signal, _left, callEnded) => {
      callEnded(); // whyNotStart: synchronous, before track() has even set `done`
      await settle.promise;
    },
  });
  const release = queue.reserve(2);
  queue.execute(fakeClaimedRun(id(1)));
  queue.execute(fakeClaimedRun(id(2)));
  release();
  assert.deepEqual(internals(queue), { settling: 2, executing: 2, reserved: 0 });
  assert.equal(queue.freeSlots(), 2);
  settle.open();
  await sleep(10);
  assert.deepEqual(internals(queue), { settling: 0, executing: 0, reserved: 0 });
  await queue.drain(100, new Error('test over'));
});

test('(a) the poller replacing a settling execution of the same run: settling decremented exactly once', async () => {
  const firstSettle = gate();
  const secondCall = gate();
  let firstCallEnded!: () => void;
  const queue = makeQueue({
    concurrency: 2,
    run: async (run, _signal, _left, callEnded) => {
      if (run.attempt === 1) {
        firstCallEnded = callEnded;
        callEnded();
        await firstSettle.promise; // winding down
      } else {
        await secondCall.promise; // the poller's claim, in its call
        callEnded();
      }
    },
  });
  queue.hold(message(id(1), 1));
  await sleep(20);
  assert.equal(internals(queue).settling, 1);
  const release = queue.reserve(queue.freeSlots());
  queue.execute(fakeClaimedRun(id(1), 2)); // replaces the settling entry
  release();
  assert.deepEqual(
    [...queue.claims()].map((c) => c.attempt),
    [2],
  );
  assert.ok(internals(queue).settling <= 1);
  firstCallEnded(); // the replaced one again: ignored
  firstSettle.open(); // its finally must neither remove the poller's entry nor decrement
  await sleep(10);
  assert.deepEqual(internals(queue), { settling: 0, executing: 1, reserved: 0 });
  assert.equal(queue.freeSlots(), 1);
  secondCall.open();
  await sleep(10);
  assert.deepEqual(internals(queue), { settling: 0, executing: 0, reserved: 0 });
  await queue.drain(100, new Error('test over'));
});

test('(b) drain is not idle while an execution settles, and waits for its write', async () => {
  const settle = gate();
  let written = false;
  let aborted = false;
  const queue = makeQueue({
    run: async (_run, signal, _left, callEnded) => {
      callEnded();
      await settle.promise;
      aborted = signal.aborted;
      written = true;
    },
  });
  queue.hold(message(id(1)));
  await sleep(20);
  let drained = false;
  const drain = queue.drain(2_000, new Error('stopping')).then(() => (drained = true));
  await sleep(50);
  assert.equal(drained, false, 'drain found the queue idle while an outcome was being written');
  settle.open();
  await drain;
  assert.equal(written, true);
  assert.equal(aborted, false, 'a write done within the deadline was treated as left past it');
});

test('(b) past the deadline a settling execution is aborted (harmlessly), awaited, and the retry it announced is handed off', async () => {
  const settle = gate();
  const handedOff: RunMessage[] = [];
  const queue: RunQueue = makeQueue({
    handOff: (messages) => handedOff.push(...messages),
    run: async (run, signal, _left, callEnded) => {
      if (run.attempt !== 1) throw new Error('the retry must not run here');
      callEnded();
      await settle.promise;
      assert.equal(signal.aborted, true); // the drain aborted it, after its call ended
    },
  });
  queue.hold(message(id(1), 1));
  await sleep(20);
  // The settle's transaction announced attempt 2; its message arrives before the drain.
  queue.hold(message(id(1), 2));
  let drained = false;
  const drain = queue.drain(50, new Error('stopping')).then(() => (drained = true));
  await sleep(120); // past the deadline: the drain waits for the write (bounded at 5 s)
  assert.equal(drained, false);
  settle.open();
  await drain;
  assert.deepEqual(
    handedOff.map((m) => m.attempt),
    [2],
  );
});

test('(c) a retry announced while its attempt settles is held and claimed after the write, never alongside it', async () => {
  const settle = gate();
  const claims: number[] = [];
  const events: string[] = [];
  const queue = makeQueue({
    concurrency: 1,
    claim: async (request) => {
      claims.push(request.attempt);
      events.push(`claim ${request.runId.slice(-1)}:${request.attempt}`);
      return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
    },
    run: async (run, _signal, _left, callEnded) => {
      events.push(`call ${run.id.slice(-1)}:${run.attempt}`);
      callEnded();
      if (run.id === id(1) && run.attempt === 1) {
        await settle.promise;
        events.push('written 1:1');
      }
    },
  });
  queue.hold(message(id(1), 1));
  await sleep(20);
  queue.hold(message(id(1), 2)); // the retry, announced by the settle that is not done yet
  queue.hold(message(id(1), 1)); // a re-delivery of the old one changes nothing
  queue.hold(message(id(2), 1)); // another run takes the slot given back meanwhile
  await sleep(30);
  assert.deepEqual(events, ['claim 1:1', 'call 1:1', 'claim 2:1', 'call 2:1']);
  settle.open();
  await sleep(30);
  assert.deepEqual(events.slice(4), ['written 1:1', 'claim 1:2', 'call 1:2']);
  assert.deepEqual(claims, [1, 1, 2]);
  await queue.drain(100, new Error('test over'));
});

test('(d) at most `concurrency` calls in flight, whatever the interleaving of calls, callEnded and writes (randomised)', async () => {
  let seed = 7446;
  const random = () => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
  // claimGraceMs 0: no claim ahead of the free slots; 10 s: runs are claimed ahead, calls still bounded.
  for (const [concurrency, claimGraceMs] of [
    [1, 0],
    [2, 0],
    [3, 0],
    [1, 10_000],
    [3, 10_000],
  ] as const) {
    const target = new Target();
    let claimsOpen = 0;
    let maxSlotsUsed = 0;
    const queue = makeQueue({
      concurrency,
      claimGraceMs,
      claim: async (request) => {
        claimsOpen += 1;
        maxSlotsUsed = Math.max(maxSlotsUsed, claimsOpen + target.inFlight);
        await sleep(Math.floor(random() * 3));
        claimsOpen -= 1;
        return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
      },
      run: async (_run, _signal, _left, callEnded) => {
        const kind = random();
        if (kind < 0.15) {
          callEnded(); // the call is not made (claim too late, stopping)
        } else if (kind < 0.25) {
          // a replace run replaced before its call: returns without callEnded
          await sleep(Math.floor(random() * 3));
          return;
        } else {
          target.begin();
          await sleep(Math.floor(random() * 6));
          target.end();
          callEnded();
          if (random() < 0.2) callEnded();
        }
        await sleep(Math.floor(random() * 10)); // the write, sometimes slower than the calls
        if (random() < 0.05) throw new Error('settle threw');
      },
    });
    let next = 1;
    const poller = (async () => {
      for (let round = 0; round < 30; round++) {
        const free = queue.freeSlots();
        if (free > 0) {
          const release = queue.reserve(free);
          await sleep(Math.floor(random() * 3)); // claimOverdue
          const n = Math.floor(random() * (free + 1));
          for (let i = 0; i < n; i++) queue.execute(fakeClaimedRun(id(100_000 + next++)));
          release();
        }
        await sleep(2);
      }
    })();
    for (let n = 1; n <= 150; n++) {
      queue.hold(message(id(n)));
      if (n % 10 === 0) await sleep(3);
    }
    await poller;
    await queue.drain(5_000, new Error('test over'));
    assert.ok(
      target.max <= concurrency,
      `${target.max} calls in flight at once with concurrency ${concurrency}`,
    );
    if (claimGraceMs === 0) {
      assert.ok(
        maxSlotsUsed <= concurrency,
        `${maxSlotsUsed} claims and calls at once with concurrency ${concurrency}`,
      );
    }
    assert.equal(target.max, concurrency, 'the test never filled the slots');
    assert.deepEqual(internals(queue), { settling: 0, executing: 0, reserved: 0 });
  }
});

test('(d) settling runs beyond `concurrency` keep their slots: no more than 2 × concurrency runs in the queue', async () => {
  const settles: (() => void)[] = [];
  let started = 0;
  const queue = makeQueue({
    concurrency: 2,
    run: async (_run, _signal, _left, callEnded) => {
      started += 1;
      callEnded();
      const g = gate();
      settles.push(g.open);
      await g.promise;
    },
  });
  for (let n = 1; n <= 10; n++) queue.hold(message(id(n)));
  await sleep(30);
  assert.equal(started, 4); // 2 settling in freed slots + 2 settling holding theirs
  assert.equal(queue.freeSlots(), 0);
  settles.shift()!();
  await sleep(10);
  assert.equal(started, 5);
  while (settles.length > 0) {
    settles.shift()!();
    await sleep(5);
  }
  await sleep(20);
  assert.equal(started, 10);
  await queue.drain(1_000, new Error('test over'));
});

test('(e) freeSlots counts settling runs as free only up to `concurrency`; a reservation keeps them from ready runs', async () => {
  const target = new Target();
  const settle = gate();
  const calls = new Map<string, () => void>();
  const queue = makeQueue({
    concurrency: 2,
    run: async (run, _signal, _left, callEnded) => {
      target.begin();
      const g = gate();
      calls.set(run.id, g.open);
      await g.promise;
      target.end();
      callEnded();
      await settle.promise;
    },
  });
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await sleep(20);
  assert.equal(queue.freeSlots(), 0); // two calls, one ready
  calls.get(id(1))!(); // its call ends: the ready one takes the slot
  await sleep(10);
  assert.equal(target.inFlight, 2);
  assert.equal(queue.freeSlots(), 0);
  calls.get(id(2))!();
  calls.get(id(3))!();
  await sleep(10);
  assert.equal(internals(queue).settling, 3);
  assert.equal(queue.freeSlots(), 1); // 3 settling: one beyond `concurrency` keeps its slot
  const release = queue.reserve(queue.freeSlots());
  queue.hold(message(id(4))); // falls due while the poll claims: must wait for the reservation
  await sleep(10);
  assert.equal(calls.has(id(4)), false);
  queue.execute(fakeClaimedRun(id(5)));
  release();
  await sleep(10);
  assert.equal(target.inFlight, 1);
  assert.equal(calls.has(id(4)), false, 'the ready run took a slot a settling run beyond concurrency keeps');
  settle.open(); // writes done: 4 gets its slot
  await sleep(10);
  assert.equal(target.inFlight, 2);
  assert.ok(target.max <= 2);
  calls.get(id(4))!();
  calls.get(id(5))!();
  await queue.drain(1_000, new Error('test over'));
  assert.deepEqual(internals(queue), { settling: 0, executing: 0, reserved: 0 });
});

// Not introduced by ca95588 (the map entry was replaced the same way before), but on the lines it
// changed: the poller's execute() of a run whose execution here is still in its call (its claim
// expired and the reaper re-queued it, e.g. after an event-loop stall) drops that execution from
// `executing`. Its call goes on uncounted and unaborted until the claim watch's next check, so a
// ready run takes its slot: concurrency + 1 calls, two of them for the same run.

test('(d, pre-existing) an execution the poller replaces while still in its call keeps its slot', async () => {
  const target = new Target();
  const calls = new Map<string, () => void>();
  const queue = makeQueue({
    concurrency: 2,
    run: async (run, signal, _left, callEnded) => {
      target.begin();
      const g = gate();
      calls.set(`${run.id.slice(-1)}:${run.attempt}`, g.open);
      await Promise.race([g.promise, new Promise((resolve) => signal.addEventListener('abort', resolve))]);
      target.end();
      callEnded();
    },
  });
  queue.hold(message(id(1), 1));
  await sleep(20);
  assert.equal(queue.freeSlots(), 1);
  const release = queue.reserve(1); // a poll: run 1's claim expired meanwhile and was re-queued
  queue.execute(fakeClaimedRun(id(1), 2));
  release();
  queue.hold(message(id(2), 1));
  queue.hold(message(id(3), 1));
  await sleep(20);
  try {
    assert.ok(target.max <= 2, `${target.max} calls in flight with concurrency 2 (${[...calls.keys()]})`);
  } finally {
    for (const open of calls.values()) open();
    await sleep(10);
    for (const open of calls.values()) open();
    await queue.drain(100, new Error('test over'));
  }
});

test('(f) writes held back while calls are underway give their slots back, and go once the calls are over', async () => {
  // attempt.ts's success path with the worker's wiring: the write is a MicroBatcher item that may
  // wait while the queue says calls are underway (worker.ts, batching.ts).
  const written: string[][] = [];
  const openBatch = gate();
  let started = 0;
  let startedBeforeWrites: number | undefined;
  const { queue, writes } = queueWithHeldWrites(
    {
      concurrency: 2,
      run: async (run, _signal, _left, callEnded) => {
        started += 1;
        await sleep(1); // the call
        callEnded(true, true);
        await writes.add(run.id, true);
      },
    },
    async (ids: string[]) => {
      written.push(ids);
      startedBeforeWrites ??= started;
      await openBatch.promise;
      return ids.map(() => true);
    },
  );
  for (let n = 1; n <= 10; n++) queue.hold(message(id(n)));
  await until(() => written.length > 0, 'the held writes to go');
  // Settling runs beyond `concurrency` would keep their slots (test d): 4 calls, then nothing
  // until a write; held writes do not, so every call began first, and the writes went once the
  // last call was over (that one's own write may follow in a second statement).
  assert.equal(startedBeforeWrites, 10);
  assert.ok(written[0]!.length >= 8, `first batch ${written[0]!.length} writes`);
  assert.equal(queue.callsUnderway(), false);
  openBatch.open();
  await until(() => internals(queue).executing === 0, 'the executions to end');
  assert.equal(written.flat().length, 10);
  assert.equal(writes.held, 0);
  assert.deepEqual(internals(queue), { settling: 0, executing: 0, reserved: 0 });
  await queue.drain(1_000, new Error('test over'));
});

test('(f) a drain does not wait for held writes: they go once it begins', async () => {
  const written: string[][] = [];
  const blocker = gate();
  const { queue, writes } = queueRecordingWrites(
    {
      concurrency: 1,
      run: async (run, _signal, _left, callEnded) => {
        if (run.id === id(2)) await blocker.promise; // a long call: run 3 waits for its slot
        callEnded(true, true);
        await writes.add(run.id, true);
      },
    },
    written,
  );
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await until(() => writes.held === 1, 'run 1 to be written later');
  assert.equal(queue.callsUnderway(), true, 'run 3 waits for a slot');
  assert.equal(written.length, 0);
  const drained = queue.drain(5_000, new Error('test over'));
  await until(() => written.length > 0, 'the held write to go when the drain begins');
  assert.deepEqual(written[0], [id(1)]);
  blocker.open();
  await drained;
});

test('(f) the settling and held-completion gauges count a held write until it is written', async () => {
  const metrics = createMetrics('test');
  const gauge = async (name: 'runsSettling' | 'completionsHeld') =>
    (await metrics[name].get()).values[0]?.value;
  const blocker = gate();
  const { queue, writes } = queueWithHeldWrites(
    {
      concurrency: 1,
      metrics,
      run: async (run, _signal, _left, callEnded) => {
        if (run.id === id(2)) await blocker.promise; // run 3 waits for its slot: calls are underway
        callEnded(true, true);
        await writes.add(run.id, true);
      },
    },
    async (ids: string[]) => ids.map(() => true),
  );
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await until(() => writes.held === 1, 'run 1 to be written later');
  assert.equal(await gauge('runsSettling'), 1);
  assert.equal(await gauge('completionsHeld'), 1);
  blocker.open();
  await until(() => internals(queue).executing === 0, 'the executions to end');
  assert.equal(await gauge('runsSettling'), 0);
  assert.equal(await gauge('completionsHeld'), 0);
  await queue.drain(1_000, new Error('test over'));
});

test('(g) the claim watch leaves out settling runs: their call is over, nothing is left to abort', async () => {
  const settle = gate();
  const call = gate();
  const queue = makeQueue({
    concurrency: 2,
    run: async (run, _signal, _left, callEnded) => {
      if (run.id === id(2)) await call.promise;
      callEnded();
      await settle.promise;
    },
  });
  queue.hold(message(id(1)));
  queue.hold(message(id(2)));
  await until(() => internals(queue).settling === 1, 'run 1 to settle');
  assert.deepEqual(
    [...queue.claims()].map((c) => c.runId),
    [id(2)],
  );
  call.open();
  settle.open();
  await until(() => internals(queue).executing === 0, 'the executions to end');
  await queue.drain(100, new Error('test over'));
});

test('(f) held writes wait for the calls of a backlog still in flight, not only for the runs waiting for a slot', async () => {
  // Going as soon as the last run had a slot, a herd's writes delayed its last calls' STARTs.
  // Run 3 is the last of the backlog: it waited for run 1's slot.
  const { queue, writes, written, open } = queueWithGatedCalls({ concurrency: 2 }, [id(3)], async (runId) => {
    if (runId === id(2)) await sleep(5);
  });
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await until(() => writes.held === 2, 'runs 1 and 2 to be written later');
  await sleep(20);
  assert.equal(written.length, 0, 'held while run 3, which waited for its slot, is in its call');
  assert.equal(queue.callsUnderway(), true);
  open(id(3));
  await until(() => written.flat().length === 3, 'the writes once the calls are over');
  await queue.drain(1_000, new Error('test over'));
});

test('(f) runs claimed together in one pump did not wait for each other: a long one among them holds no write back', async () => {
  const { queue, written, open } = queueWithGatedCalls({ concurrency: 2 }, [id(2)]);
  // Both wait for the same instant, so one pump claims them, run 2 (the long call) second.
  const at = new Date(Date.now() + 30);
  queue.hold({ ...message(id(1)), scheduledFor: at, notBefore: at });
  queue.hold({ ...message(id(2)), scheduledFor: at, notBefore: at });
  await until(() => written.length > 0, 'run 1 written while run 2 is in its call');
  assert.deepEqual(written, [[id(1)]]);
  open(id(2));
  await until(() => written.flat().length === 2, 'run 2 written');
  await queue.drain(1_000, new Error('test over'));
});

test('(f) a call that got its slot with nothing waiting holds no write back: a long call beside a light load', async () => {
  const { queue, writes, written, open } = queueWithGatedCalls({ concurrency: 2 }, [id(1)]);
  queue.hold(message(id(1)));
  await until(() => internals(queue).executing === 1 && queue.callsUnderway() === false, 'run 1 in its call');
  queue.hold(message(id(2)));
  await until(() => written.length > 0, 'run 2 written while run 1 is in its call');
  assert.deepEqual(written, [[id(2)]]);
  assert.equal(writes.held, 0);
  open(id(1));
  await until(() => written.flat().length === 2, 'run 1 written');
  await queue.drain(1_000, new Error('test over'));
});
