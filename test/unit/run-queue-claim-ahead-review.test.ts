import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { DbClock } from '../../src/execution/db-clock.js';
import { ClaimLostError } from '../../src/errors.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { RunQueue, startPasses, type RunQueueOptions } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { AttemptReport } from '../../src/store/attempts.js';
import type { Connections } from '../../src/store/pool-share.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { gate, queueCounters, setCallTime, testRunQueue, until } from '../support/run-queue.js';

// Review of 9166bae (claims no longer take an execution slot): interleavings between a claimed
// run's wait for its slot and aborts, the poller, drains and the claim-ahead budget. Fakes only.
// Part 1 pins interleavings that hold; part 2 shows how the claim-ahead budget (callMs) lets
// claimed runs wait for a slot until their claim is too short to call (attempt.ts whyNotStart,
// `claim-too-late`), using the real runAttempt so that the outcome is attempt.ts's own.

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

function message(runId: string, attempt = 1, notBefore = new Date()): RunMessage {
  return { runId, jobId: runId, attempt, scheduledFor: notBefore, notBefore };
}

/** The counters that return to zero once a queue is idle. */
function counters(queue: RunQueue) {
  const { slotted, ahead, settling, reserved, executing, superseded, slotWaiters } = queueCounters(queue);
  return { slotted, ahead, settling, reserved, executing, superseded, waiters: slotWaiters };
}

const IDLE: ReturnType<typeof counters> = {
  slotted: 0,
  ahead: 0,
  settling: 0,
  reserved: 0,
  executing: 0,
  superseded: 0,
  waiters: 0,
};

function assertIdle(queue: RunQueue, concurrency: number): void {
  assert.deepEqual(counters(queue), IDLE, 'counters back to zero');
  assert.equal(queue.freeSlots(), concurrency, 'every slot free again');
}

const callMsOf = (queue: RunQueue) => (queue as unknown as { callMs: number }).callMs;
/** Sets the call time estimate as a node that has timed many calls has it (a moving average). */
const setCallMs = (queue: RunQueue, ms: number) => setCallTime(queue, ms);

interface Seen {
  claimed: string[];
  /** Calls made: run() given a signal not aborted (attempt.ts would call the target). */
  called: string[];
  /** run() given an aborted signal: attempt.ts makes no call. */
  notCalled: { runId: string; reason: unknown; drainLeftMs?: number }[];
  inFlight: number;
  maxInFlight: number;
  /** The open calls, by run id (opened in order by `calls.shift()`). */
  calls: { runId: string; open: () => void }[];
}

/**
 * A queue whose `run` plays attempt.ts: with an aborted signal it makes no call (callEnded at once,
 * then the hand-back write, `notCalledWrite`); otherwise the call waits for its gate or an abort.
 */
function makeQueue(
  overrides: Partial<RunQueueOptions> = {},
  hooks: { notCalledWrite?: Promise<void>; onCall?: (runId: string, callEnded: () => void) => void } = {},
): { queue: RunQueue; seen: Seen } {
  const seen: Seen = { claimed: [], called: [], notCalled: [], inFlight: 0, maxInFlight: 0, calls: [] };
  const queue = testRunQueue({
    claim: async (request) => {
      seen.claimed.push(request.runId);
      return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
    },
    claimGraceMs: 10_000,
    concurrency: 1,
    run: async (run, signal, drainLeftMs, callEnded) => {
      if (signal.aborted) {
        seen.notCalled.push({ runId: run.id, reason: signal.reason, drainLeftMs: drainLeftMs?.() });
        callEnded();
        await hooks.notCalledWrite;
        return;
      }
      seen.called.push(run.id);
      seen.inFlight += 1;
      seen.maxInFlight = Math.max(seen.maxInFlight, seen.inFlight);
      const call = gate();
      seen.calls.push({ runId: run.id, open: call.open });
      await Promise.race([
        call.promise,
        new Promise((resolve) => signal.addEventListener('abort', resolve, { once: true })),
      ]);
      seen.inFlight -= 1;
      if (hooks.onCall) hooks.onCall(run.id, callEnded);
      else callEnded();
    },
    ...overrides,
  });
  // A node whose calls have taken 50 ms (the queue's own initial assumption, set explicitly so that
  // these tests do not depend on how a node with no call yet estimates).
  setCallMs(queue, 50);
  return { queue, seen };
}

/** Opens the calls one by one until `calls` runs have been called and none is open (bounded). */
async function drive(seen: Seen, calls: number, timeoutMs = 5_000): Promise<void> {
  const end = performance.now() + timeoutMs;
  while (seen.called.length < calls || seen.calls.length > 0) {
    if (performance.now() > end) assert.fail(`${seen.called.length} of ${calls} runs called`);
    seen.calls.shift()?.open();
    await sleep(1);
  }
}

/** The claim the watch sees for `runId` (waiting executions included). */
function claimOf(queue: RunQueue, runId: string): { controller: AbortController } {
  const claim = [...queue.claims()].find((c) => c.runId === runId);
  assert.ok(claim, `no claim of ${runId}`);
  return claim;
}

// ---------------------------------------------------------------------------------------------
// Part 1: interleavings that hold (regression tests)
// ---------------------------------------------------------------------------------------------

test('abort racing a slot grant in the same tick: granted first, then aborted, makes no call and leaks nothing', async () => {
  let raced = false;
  const { queue, seen } = makeQueue(
    { concurrency: 1 },
    {
      onCall: (runId, callEnded) => {
        callEnded(); // run 1's call ends: pump() grants run 2 its slot, synchronously...
        if (runId === id(1) && !raced) {
          raced = true;
          // ...and in the same tick, before run 2's continuation, the claim watch aborts it.
          assert.equal(counters(queue).waiters, 1, 'run 3 still waits');
          claimOf(queue, id(2)).controller.abort(new Error('claim lost'));
        }
      },
    },
  );
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await until(() => seen.called.length === 1 && counters(queue).waiters === 2, 'run 1 calling');
  seen.calls.shift()!.open();
  await until(() => seen.called.length === 2, 'run 3 called');
  assert.deepEqual(seen.called, [id(1), id(3)]);
  assert.deepEqual(
    seen.notCalled.map((n) => n.runId),
    [id(2)],
  );
  assert.equal(seen.maxInFlight, 1);
  seen.calls.shift()!.open();
  await until(() => counters(queue).executing === 0, 'all ended');
  assertIdle(queue, 1);
  await queue.drain(100, new Error('test over'));
});

test('abort racing a slot grant in the same tick: aborted first, the slot goes to the next waiter', async () => {
  const { queue, seen } = makeQueue(
    { concurrency: 1 },
    {
      onCall: (runId, callEnded) => {
        // Aborted while waiting, then run 1's call ends in the same tick.
        if (runId === id(1)) claimOf(queue, id(2)).controller.abort(new Error('claim lost'));
        callEnded();
      },
    },
  );
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await until(() => seen.called.length === 1 && counters(queue).waiters === 2, 'run 1 calling');
  seen.calls.shift()!.open();
  await until(() => seen.called.length === 2, 'run 3 called');
  assert.deepEqual(seen.called, [id(1), id(3)]);
  assert.deepEqual(
    seen.notCalled.map((n) => n.runId),
    [id(2)],
  );
  seen.calls.shift()!.open();
  await until(() => counters(queue).executing === 0, 'all ended');
  assertIdle(queue, 1);
  await queue.drain(100, new Error('test over'));
});

test('a lost claim of a run waiting for a slot: its run() calling callEnded() frees no slot (no call on top)', async () => {
  // attempt.ts calls callEnded() before handing an unstarted claim back; for an execution without a
  // slot that must not count as a settling call, or the next waiter would be granted a slot that
  // run 1's call still holds.
  const release = gate();
  const { queue, seen } = makeQueue({ concurrency: 1 }, { notCalledWrite: release.promise });
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await until(() => seen.called.length === 1 && counters(queue).waiters === 2, 'run 1 calling');
  claimOf(queue, id(2)).controller.abort(new Error('claim lost'));
  await until(() => seen.notCalled.length === 1, 'run 2 handed to run() aborted');
  await sleep(10); // its hand-back write is still open
  assert.deepEqual(seen.called, [id(1)], 'run 3 waits: run 1 still holds the only slot');
  assert.equal(counters(queue).settling, 0);
  assert.equal(seen.maxInFlight, 1);
  release.open();
  seen.calls.shift()!.open();
  await until(() => seen.called.length === 2, 'run 3 called');
  seen.calls.shift()!.open();
  await until(() => counters(queue).executing === 0, 'all ended');
  assert.equal(seen.maxInFlight, 1);
  assertIdle(queue, 1);
  await queue.drain(100, new Error('test over'));
});

test('the poller superseding a claimed run waiting for a slot: the old execution makes no call, the run is called once', async () => {
  const { queue, seen } = makeQueue({ concurrency: 1 });
  // The poll reserved the only slot (a reservation is taken before its claims come back), then run
  // 1's announcement was claimed and waits for that slot; the poll's claim of the same run (its
  // attempt 2: the first claim expired meanwhile) is executed in the reserved slot.
  const release = queue.reserve(queue.freeSlots());
  queue.hold(message(id(1)));
  await until(() => counters(queue).waiters === 1, 'run 1 waiting for a slot');
  queue.execute(fakeClaimedRun(id(1), 2));
  release();
  await until(() => seen.called.length === 1, 'the poller’s execution calling');
  await sleep(10);
  assert.deepEqual(seen.called, [id(1)]);
  assert.equal(seen.notCalled.length, 1);
  assert.match(String(seen.notCalled[0]!.reason), /claimed again by this node/);
  assert.equal(counters(queue).waiters, 0, 'the superseded execution left the waiters');
  seen.calls.shift()!.open();
  await until(() => counters(queue).executing === 0, 'all ended');
  await sleep(10);
  assert.deepEqual(seen.called, [id(1)], 'called once');
  assert.equal(seen.maxInFlight, 1);
  assertIdle(queue, 1);
  await queue.drain(100, new Error('test over'));
});

test('a rehold outcome takes no slot and leaks nothing; the run is claimed again and called once', async () => {
  let tries = 0;
  const { queue, seen } = makeQueue({
    concurrency: 1,
    claim: async (request) => {
      seen.claimed.push(request.runId);
      tries += 1;
      if (tries === 1) return { kind: 'rehold', notBefore: new Date(Date.now() + 20) };
      return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
    },
  });
  queue.hold(message(id(1)));
  await until(() => seen.called.length === 1, 'run 1 called after its rehold');
  seen.calls.shift()!.open();
  await until(() => counters(queue).executing === 0, 'all ended');
  assert.equal(tries, 2);
  assert.deepEqual(seen.called, [id(1)]);
  assertIdle(queue, 1);
  await queue.drain(100, new Error('test over'));
});

test('a drain with runs claiming, claimed ahead of their time and waiting for a slot: none is called, it ends on time', async () => {
  const clock = new DbClock();
  const slowClaim = gate();
  const { queue, seen } = makeQueue({
    concurrency: 1,
    claimLeadMs: 5_000,
    claim: async (request) => {
      seen.claimed.push(request.runId);
      if (request.runId === id(4)) await slowClaim.promise; // its claim comes back after the deadline
      const run = fakeClaimedRun(request.runId, request.attempt);
      // run 3 is claimed 3 s ahead of its time (the lead), and waits for it
      if (request.runId === id(3)) return { kind: 'claimed', run: { ...run, notBefore: request.notBefore } };
      return { kind: 'claimed', run };
    },
    clock,
  });
  queue.hold(message(id(1)));
  queue.hold(message(id(2)));
  queue.hold(message(id(3), 1, new Date(clock.now() + 3_000)));
  queue.hold(message(id(4)));
  await until(() => seen.claimed.length === 4 && counters(queue).waiters === 1, 'runs claimed');
  const stop = new Error('stopping');
  const started = performance.now();
  const drained = queue.drain(100, stop);
  await sleep(150);
  slowClaim.open();
  await drained;
  const took = performance.now() - started;
  assert.ok(took < 1_500, `drain took ${Math.round(took)} ms`);
  assert.deepEqual(seen.called, [id(1)], 'only the call in flight before the drain');
  assert.deepEqual(seen.notCalled.map((n) => n.runId).sort(), [id(2), id(3), id(4)]);
  // Aborted by the drain (attempt.ts hands each back: stopping): the claimed runs whose calls
  // could not end before the deadline at its start, run 4 once its claim came back after it.
  for (const n of seen.notCalled) assert.equal(n.reason, stop);
  const leftAt = new Map(seen.notCalled.map((n) => [n.runId, n.drainLeftMs!]));
  assert.ok(leftAt.get(id(2))! > 50 && leftAt.get(id(3))! > 50, JSON.stringify([...leftAt]));
  assert.ok(leftAt.get(id(4))! <= 0, JSON.stringify([...leftAt]));
  assert.ok(queue.watchSignal.aborted);
  assert.deepEqual(counters(queue), IDLE);
});

test('claim budget at the extremes: a call time of 0 with no grace still claims for free slots; a huge one claims no further', async () => {
  // callMs 0 (calls ending in the tick they got their slot) with claimGraceMs 0 is 0 / 0 without the
  // Math.max(1, …): a NaN budget, and nothing would ever be claimed again.
  const tiny = makeQueue({ concurrency: 2, claimGraceMs: 0 });
  setCallMs(tiny.queue, 0);
  for (let n = 1; n <= 5; n++) tiny.queue.hold(message(id(n)));
  await until(() => tiny.seen.called.length === 2, 'two calls');
  assert.equal(tiny.seen.claimed.length, 2, 'one claim per free slot');
  // A tiny call time with grace: bounded by the prefetch, never Infinity or NaN.
  const fast = makeQueue({ concurrency: 2, claimGraceMs: 10_000, prefetch: 7 });
  setCallMs(fast.queue, 1e-9);
  for (let n = 11; n <= 30; n++) fast.queue.hold(message(id(n)));
  await until(() => fast.seen.called.length === 2, 'two calls');
  await sleep(10);
  assert.equal(fast.seen.claimed.length, 2 + 7, 'free slots + at most `prefetch` ahead');
  // A huge call time: a run is claimed only for a free slot.
  const slow = makeQueue({ concurrency: 2, claimGraceMs: 10_000 });
  setCallMs(slow.queue, 1e9);
  for (let n = 31; n <= 40; n++) slow.queue.hold(message(id(n)));
  await until(() => slow.seen.called.length === 2, 'two calls');
  await sleep(10);
  assert.equal(slow.seen.claimed.length, 2);
  for (const q of [tiny, fast, slow]) {
    await drive(q.seen, 5 + (q === tiny ? 0 : q === fast ? 15 : 5));
    await until(() => counters(q.queue).executing === 0, 'all ended');
    assert.equal(q.seen.maxInFlight, 2);
  }
  await Promise.all([tiny, fast, slow].map((q) => q.queue.drain(100, new Error('over'))));
});

test('pump re-entered from onBackpressure (announcements delivered synchronously): budget and slots still hold', async () => {
  let delivered = false;
  const box: { queue?: RunQueue } = {};
  const clock = new DbClock();
  const { queue, seen } = makeQueue({
    concurrency: 2,
    claimGraceMs: 200, // 2 × 100 / 50 = 4 beyond the free slots, capped at the prefetch (3)
    prefetch: 3,
    clock,
    onBackpressure: (full) => {
      // Resuming the intake delivers announcements at once: hold() → pump() inside pump()'s
      // claim loop (track() → update()), while the outer loop is still claiming.
      if (!full && box.queue && !delivered) {
        delivered = true;
        for (let n = 10; n <= 18; n++) box.queue.hold(message(id(n)));
      }
    },
  });
  box.queue = queue;
  // Three not yet due: held, the prefetch is full. When they fall due the first claim frees room.
  const soon = new Date(clock.now() + 30);
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n), 1, soon));
  await until(() => delivered && seen.called.length === 2, 'calls started');
  await sleep(20);
  // The budget beyond the free slots is min(4, prefetch 3): exactly that many wait, the rest stay held.
  assert.equal(counters(queue).ahead, 3, 'claimed beyond the free slots: exactly the budget');
  assert.equal(seen.claimed.length, 5);
  await drive(seen, 12);
  await until(() => counters(queue).executing === 0, 'all ended');
  assert.equal(new Set(seen.called).size, 12, 'each run called once');
  assert.equal(seen.called.length, 12);
  assert.equal(seen.maxInFlight, 2);
  assertIdle(queue, 2);
  await queue.drain(100, new Error('test over'));
});

// ---------------------------------------------------------------------------------------------
// Part 2: the claim-ahead budget against the claim's deadline (real runAttempt). The first three
// failed on 9166bae, fixed since:
// - calls not made give no sample: runAttempt's callEnded(false) for whyNotStart, and
//   callEnded(report.outcome !== 'cancelled') after the executor; RunQueue.callEnded(execution,
//   called = true) samples callMs only when `called`;
// - a run that keeps its slot past `concurrency` settling runs is sampled when it gives the slot
//   back (its write ended, in track()'s finally), not when its call ended;
// - a fresh node's guess (50 ms) is replaced by the mean of its first calls timed, so slower
//   targets cost claims handed back from its first herd only (the last test).
// ---------------------------------------------------------------------------------------------

interface Harness {
  queue: RunQueue;
  /** Calls made at the target. */
  made: string[];
  /** Claims handed back uncalled (attempt.ts's release). */
  handedBack: number;
  claimed: number;
}

/**
 * A RunQueue whose `run` is the real runAttempt: a claim is due when made, and expires at
 * not_before + timeout + grace as store/runs.ts sets it; the target answers in `callMs`, the
 * completion write takes `writeMs`. `expired` makes the claim answer with too little time left.
 */
function attemptQueue(options: {
  concurrency: number;
  claimGraceMs: number;
  callMs: number | (() => Promise<void>);
  writeMs?: number;
  timeoutMs?: number;
  expired?: boolean;
  /** A node that has made no call yet: its own initial estimate; otherwise calls took 50 ms so far. */
  cold?: boolean;
}): Harness {
  const clock = new DbClock();
  const metrics = createMetrics('test');
  const timeoutMs = options.timeoutMs ?? 50;
  const h: Harness = { queue: undefined as unknown as RunQueue, made: [], handedBack: 0, claimed: 0 };
  // The pool answers nothing: the clock estimate re-sampled after a hand-back (claim-too-late)
  // finds no database time and stays as it is.
  const client = { query: async () => ({ rows: [] }), on() {}, removeListener() {}, release() {} };
  const pool = { connect: async () => client, query: async () => ({ rows: [] }) } as unknown as Connections;
  const executor = {
    execute: async (run: ClaimedRun, cancel: AbortSignal): Promise<AttemptReport> => {
      if (cancel.aborted) {
        return {
          outcome: 'cancelled',
          statusCode: null,
          durationMs: 0,
          error: 'aborted',
          responseExcerpt: null,
        };
      }
      h.made.push(run.id);
      if (typeof options.callMs === 'number') await sleep(options.callMs);
      else await options.callMs();
      return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: null };
    },
  } as unknown as HttpExecutor;
  const ctx: AttemptContext = {
    pool,
    nodeId: 'node-a',
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock,
    start: async () => true,
    complete: async () => {
      if (options.writeMs) await sleep(options.writeMs);
      return true;
    },
    release: async (run) => {
      h.handedBack += 1;
      return message(run.id, run.attempt + 1);
    },
    logger: silentLogger,
    metrics,
  };
  h.queue = new RunQueue({
    claim: async (request) => {
      h.claimed += 1;
      const notBefore = new Date(clock.now());
      const expiresAt = options.expired
        ? notBefore.getTime() + timeoutMs // already too short to call
        : notBefore.getTime() + timeoutMs + options.claimGraceMs;
      return {
        kind: 'claimed',
        run: {
          ...fakeClaimedRun(request.runId, request.attempt),
          notBefore,
          timeoutMs,
          claimExpiresAt: new Date(expiresAt),
        },
      };
    },
    claimLeadMs: 0,
    claimGraceMs: options.claimGraceMs,
    concurrency: options.concurrency,
    prefetch: 5000,
    clock,
    run: (run, signal, drainLeftMs, callEnded) => runAttempt(ctx, run, signal, drainLeftMs, callEnded),
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics,
  });
  if (!options.cold) setCallMs(h.queue, 50);
  return h;
}

test('claims handed back uncalled (claim-too-late) count as 0 ms calls, so the queue claims further ahead', async () => {
  // The runs that show the budget was too large (they waited past the grace) end with a ~0 ms
  // sample (slot, then callEnded() at once in attempt.ts), lowering callMs and raising the budget:
  // the more runs are handed back late, the more are claimed ahead. A positive feedback loop.
  const late = attemptQueue({ concurrency: 1, claimGraceMs: 200, callMs: 0, expired: true });
  for (let n = 1; n <= 20; n++) late.queue.hold(message(id(n)));
  await until(() => late.claimed === 20 && counters(late.queue).executing === 0, 'all handed back');
  assert.equal(late.made.length, 0);
  assert.equal(late.handedBack, 20);
  assert.equal(callMsOf(late.queue), 50, 'no call was made: the call time estimate must not move');
  assertIdle(late.queue, 1);
  await late.queue.drain(100, new Error('over'));
});

test('a call aborted between its slot and its start (claim lost) counts as a 0 ms call', async () => {
  const h = attemptQueue({ concurrency: 1, claimGraceMs: 10_000, callMs: 5 });
  // The claim watch finds runs 2–11 lost in the tick each is granted its slot, before its run()
  // continues: runAttempt gets an aborted signal, the executor answers `cancelled` without a call.
  const q = h.queue as unknown as { giveSlot: (e: { runId: string; controller: AbortController }) => void };
  const giveSlot = q.giveSlot.bind(h.queue);
  q.giveSlot = (execution) => {
    giveSlot(execution);
    if (execution.runId !== id(1)) execution.controller.abort(new ClaimLostError('claim lost'));
  };
  for (let n = 1; n <= 11; n++) h.queue.hold(message(id(n)));
  await until(() => h.claimed === 11 && counters(h.queue).executing === 0, 'all ended');
  assert.deepEqual(h.made, [id(1)]);
  // One real sample (run 1: 50 + 0.05 × (~5 − 50) ≈ 47.8); none for the ten calls never made.
  assert.ok(callMsOf(h.queue) >= 47, `callMs fell to ${callMsOf(h.queue).toFixed(1)} ms`);
  assertIdle(h.queue, 1);
  await h.queue.drain(100, new Error('over'));
});

test('with slow outcome writes (settling past `concurrency`), runs claimed ahead wait past the grace', async () => {
  // Calls end at once, writes take 100 ms: past `concurrency` settling runs a run keeps its slot
  // until a write ends, so slots free at the write pace (2 × concurrency per write), not at the
  // call time callMs measures (~0 ms). The budget grows to the prefetch and the herd waits for
  // slots far beyond the grace: attempt.ts hands most of it back uncalled (claim-too-late).
  const h = attemptQueue({ concurrency: 2, claimGraceMs: 300, callMs: 0, writeMs: 100 });
  const runs = 40;
  for (let n = 1; n <= runs; n++) h.queue.hold(message(id(n)));
  await until(() => counters(h.queue).executing === 0, 'all ended', 15_000);
  assertIdle(h.queue, 2);
  assert.equal(h.made.length + h.handedBack, runs);
  assert.ok(
    h.handedBack <= runs / 10,
    `${h.handedBack} of ${runs} claims handed back uncalled (claim-too-late)`,
  );
  await h.queue.drain(100, new Error('over'));
});

test('a fresh node guesses 50 ms a call; against slower targets only its first over-claim is handed back, then the timed calls bound it', async () => {
  // 2 slots × (400 / 2) / 50 = 8 runs claimed beyond the 2 free slots at once; at 150 ms a call
  // the last of those wait past the 400 ms grace and are handed back uncalled (no attempt used).
  // The first call timed replaces the guess (150 ms: 2 may wait), so a second herd on the now
  // warm node loses nothing.
  const h = attemptQueue({ concurrency: 2, claimGraceMs: 400, callMs: 150, cold: true });
  const runs = 12;
  for (let n = 1; n <= runs; n++) h.queue.hold(message(id(n)));
  await until(() => counters(h.queue).executing === 0, 'all ended', 15_000);
  assertIdle(h.queue, 2);
  assert.equal(h.made.length + h.handedBack, runs);
  assert.ok(h.handedBack <= 8, `${h.handedBack} of ${runs} claims handed back uncalled (claim-too-late)`);
  assert.ok(callMsOf(h.queue) >= 100, `call time estimate ${callMsOf(h.queue)} ms`);
  const before = h.handedBack;
  for (let n = runs + 1; n <= 2 * runs; n++) h.queue.hold(message(id(n)));
  await until(() => counters(h.queue).executing === 0 && h.claimed >= 2 * runs, 'second herd ended', 15_000);
  assert.equal(h.handedBack - before, 0, 'the warm node handed back claims of the second herd');
  await h.queue.drain(100, new Error('over'));
});

test('while runs wait for slots, claims ahead are bounded by the pace slots were given, whatever the call time says', async () => {
  // A node short of CPU: its sampled call time swings with the load, and at a low sample Little's
  // law (concurrency × grace / 2 / callMs) let it claim far more ahead than its slots then started
  // within the grace (the bench: 4,000 claimed ahead at 900 starts a second; one in ten handed
  // back too late). Here the call time is held at 1 ms (a budget of 2 × 500 / 1 = 1,000, capped
  // at the prefetch) while one call ends every 10 ms: 0.1 runs per ms, 50 within half the grace.
  const { queue, seen } = makeQueue({ concurrency: 2, claimGraceMs: 1_000, prefetch: 1_000 });
  let stop = false;
  const paced = (async () => {
    while (!stop) {
      setCallMs(queue, 1);
      seen.calls.shift()?.open();
      await sleep(10);
    }
  })();
  try {
    for (let n = 1; n <= 200; n++) queue.hold(message(id(n)));
    // Waiting long enough for the pace to be measured (windows of 250 ms, from the first full one).
    await sleep(700);
    for (let n = 1001; n <= 1400; n++) queue.hold(message(id(n)));
    await sleep(20);
    const later = () => seen.claimed.filter((r) => r >= id(1001)).length;
    assert.ok(later() <= 10, `${later()} of the later 400 claimed with ≈130 already waiting (bound ≈50)`);
    // Once the first runs have drained to the bound, claims keep about that many ahead.
    await until(() => counters(queue).ahead <= 55, 'the runs ahead drained to the bound', 5_000);
    let most = 0;
    for (const end = performance.now() + 500; performance.now() < end; await sleep(5))
      most = Math.max(most, counters(queue).ahead);
    assert.ok(most <= 60, `up to ${most} claimed ahead at ≈0.1 runs per ms (bound ≈50)`);
  } finally {
    stop = true;
    await paced;
  }
  await drive(seen, 600, 20_000);
  await until(() => counters(queue).executing === 0, 'all ended');
  assert.equal(new Set(seen.called).size, 600, 'each run called once');
  assert.equal(seen.maxInFlight, 2);
  await queue.drain(100, new Error('test over'));
});

test('the claim watch leaves out runs claimed ahead until their START is under way; retries claimed ahead stay in', async () => {
  // START checks a claimed-ahead run's claim before its call; the watch checking each of them
  // every interval cost its statement ≈50 µs per run at 2,000 runs/s (a second's runs claimed ahead).
  // From its start pass on (START on its way or done, while it waits for its slot) a run is
  // watched: at most startPasses(concurrency) of them.
  const clock = new DbClock();
  const at = new Date(clock.now() + 150);
  const passes = startPasses(1);
  const runs = passes + 2;
  const retry = id(runs + 1);
  const { queue, seen } = makeQueue({
    concurrency: 1,
    claimLeadMs: 5_000,
    claim: async (request) => {
      seen.claimed.push(request.runId);
      // The retry (started before): claimed ahead, but nothing will START it.
      const startPending = request.runId !== retry;
      return {
        kind: 'claimed',
        run: { ...fakeClaimedRun(request.runId, request.attempt), notBefore: at, startPending },
      };
    },
  });
  for (let n = 1; n <= runs + 1; n++) queue.hold(message(id(n), 1, at));
  await until(() => seen.claimed.length === runs + 1, 'claimed ahead');
  await sleep(10);
  const watched = () => [...queue.claims()].map((c) => c.runId).sort();
  assert.deepEqual(watched(), [retry], 'waiting for their time: only the retry');
  await until(() => seen.called.length === 1, 'the first call');
  // One slot: the run called and the runs holding the other passes (marked started, waiting for
  // the slot) are watched; the two waiting for a pass are not.
  const holdingPasses = Array.from({ length: passes }, (_, i) => id(i + 1));
  assert.deepEqual(watched(), [...holdingPasses, retry].sort());
  await drive(seen, runs + 1);
  await until(() => counters(queue).executing === 0, 'all ended');
  assert.deepEqual(watched(), []);
  assertIdle(queue, 1);
  await queue.drain(100, new Error('test over'));
});
