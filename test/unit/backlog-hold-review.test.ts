import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import type { MicroBatcher } from '../../src/execution/micro-batcher.js';
import type { RunQueue } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import {
  drainSendsHeldWrite,
  gate,
  queueRecordingWrites,
  queueWithGatedCalls,
  queueWithHeldWrites,
  queueCounters,
  setCallTime,
  until,
} from '../support/run-queue.js';

// Review of the "backlog calls" change to RunQueue.callsUnderway(): writes are held only while
// runs wait (ready, slotWaiters) or calls that got their slot during a backlog are in flight.
// Writes are a MicroBatcher wired as the worker wires its completions (queueWithHeldWrites); its
// hold is 60 s, so a write that goes only because its hold ran out shows as a timeout here.

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;
function message(runId: string, attempt = 1, notBefore = new Date()): RunMessage {
  return { runId, jobId: runId, attempt, scheduledFor: notBefore, notBefore };
}
/** The queue's own counters, read for invariants only; `waiting` is in `ready` or for a slot. */
function internals(queue: RunQueue) {
  const { ready, slotWaiters, ...rest } = queueCounters(queue);
  return { ...rest, waiting: ready + slotWaiters };
}
const idle = {
  backlogCalls: 0,
  backlog: false,
  flagged: 0,
  settling: 0,
  slotted: 0,
  ahead: 0,
  reserved: 0,
  executing: 0,
  superseded: 0,
  waiting: 0,
};

/** Ends a test: all `runs` written, the queue drained, and its counters back to zero. */
async function endsIdle(queue: RunQueue, written: string[][], runs: number): Promise<void> {
  await until(() => written.flat().length === runs, 'all written');
  await queue.drain(1_000, new Error('test over'));
  assert.deepEqual(internals(queue), idle);
}

/** Run 1, a lone long call, gets its slot; then the poller's query reserves the free slots. */
async function longCallThenPoll(queue: RunQueue, called: Set<string>): Promise<() => void> {
  queue.hold(message(id(1)));
  await until(() => called.has(id(1)), 'run 1 (a lone long call) in its call');
  return queue.reserve(queue.freeSlots());
}

// ---- Property 3: a herd holds writes until its last call has ended ----

test('3: a herd run that waited in `ready` holds writes though the backlog calls before it end during its claim', async () => {
  // 2 slots, 3 runs due at once, no claims ahead: run 3 waits in `ready` for the claim budget.
  // Runs 1 and 2 end at once; run 3's claim takes a round trip (the claimer batches it), during
  // which no backlog call is left and nothing waits: update() clears `backlog`, run 3 gets its
  // slot as a non-backlog call, and runs 1 and 2's writes go while the herd's last call runs.
  // Test (f) in run-queue-settling only passes because its run 2 sleeps 5 ms.
  const { queue, written, called, openAll } = queueWithGatedCalls(
    {
      concurrency: 2,
      claim: async (request) => {
        if (request.runId === id(3)) await sleep(10); // a claim's round trip
        return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
      },
    },
    [id(3)],
  );
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  try {
    await until(() => called.has(id(3)), "run 3 (the herd's last) in its call");
    await sleep(20);
    assert.equal(queue.callsUnderway(), true, 'run 3 waited in ready: its call is a backlog call');
    assert.equal(written.length, 0, "runs 1 and 2 held while the herd's last call runs");
  } finally {
    openAll();
  }
  await until(() => written.flat().length === 3, 'all written once run 3 ended');
  await queue.drain(1_000, new Error('test over'));
  assert.deepEqual(internals(queue), idle);
});

test('3: a herd granted from slotWaiters (claimed ahead) holds writes until its last granted call has ended', async () => {
  // Regression: would fail if only the wait for a slot counted (writes going once the last run
  // got its slot, the pre-settling behaviour) or if grant() did not mark the run (waited=true).
  const { queue, written, called, open } = queueWithGatedCalls({ concurrency: 2, claimGraceMs: 10_000 }, [
    id(3),
    id(4),
  ]);
  setCallTime(queue, 50);
  for (let n = 1; n <= 4; n++) queue.hold(message(id(n)));
  await until(() => called.size === 4, 'all 4 in their calls');
  await sleep(20);
  assert.equal(written.length, 0, 'runs 1 and 2 held while runs 3 and 4 (granted from waiters) call');
  open(id(3));
  await sleep(20);
  assert.equal(written.length, 0, 'still held: run 4 is in its call');
  assert.equal(internals(queue).backlogCalls, 1);
  open(id(4));
  await until(() => written.flat().length === 4, 'all written once the last call ended', 500);
  await queue.drain(1_000, new Error('test over'));
  assert.deepEqual(internals(queue), idle);
});

// ---- Property 4: a call that got its slot with nothing waiting holds nothing ----

test("4: a call that starts while a backlog's calls are underway is part of it: the writes go once it and they have ended", async () => {
  // 2 slots; runs 1–3 due at once (run 3 waits in ready), runs 2 and 3 long. Run 2 ends; run 4
  // arrives while run 3, the herd's last call, is underway: a free slot and nothing waiting, but
  // the backlog is on, so run 4 is part of it (as a herd's late-claimed last runs are: writes
  // going while they call slowed them and the call time the queue samples). Once run 3 and run 4
  // have ended, the backlog is over: the writes go, and a later lone call holds nothing.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 2 },
    [2, 3, 4, 5].map(id),
  );
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  try {
    await until(() => called.has(id(3)), 'run 3 in its call');
    open(id(2));
    await until(() => internals(queue).slotted - internals(queue).settling === 1, 'only run 3 calling');
    assert.equal(internals(queue).waiting, 0, 'nothing waits');
    queue.hold(message(id(4)));
    await until(() => called.has(id(4)), 'run 4 in its call');
    open(id(3)); // the herd's last call ends; run 4, started during the backlog, has not
    await sleep(20);
    assert.equal(written.length, 0, 'held while run 4, part of the backlog, is in its call');
    assert.equal(queue.callsUnderway(), true);
    open(id(4));
    await until(() => written.flat().length === 4, 'the backlog over: all written', 500);
    assert.equal(queue.callsUnderway(), false);
    queue.hold(message(id(5))); // a lone call after the backlog: holds nothing
    await until(() => called.has(id(5)), 'run 5 in its call');
    assert.equal(queue.callsUnderway(), false);
  } finally {
    openAll();
  }
  await endsIdle(queue, written, 5);
});

test('4: a long call started with nothing waiting holds nothing, before, during and after a herd', async () => {
  // Regression: would fail if the long call were marked retroactively when a backlog forms (e.g.
  // callsUnderway counting slotted > settling while `backlog` is set), or if `backlog` were never
  // cleared after the herd.
  const { queue, written, called, openAll } = queueWithGatedCalls(
    { concurrency: 2 },
    [id(1)],
    async (runId) => {
      if (runId !== id(1)) await sleep(3);
    },
  );
  queue.hold(message(id(1)));
  await until(() => called.has(id(1)), 'run 1 (long) in its call');
  assert.equal(queue.callsUnderway(), false);
  for (let n = 2; n <= 5; n++) queue.hold(message(id(n))); // a herd on the one slot left
  try {
    await until(() => written.flat().length === 4, 'the herd written while run 1 still calls', 1_000);
    assert.equal(queue.callsUnderway(), false);
    assert.equal(internals(queue).backlogCalls, 0);
    queue.hold(message(id(6)));
    await until(() => written.flat().includes(id(6)), 'a later run written at once', 500);
  } finally {
    openAll();
  }
  await until(() => written.flat().length === 6, 'run 1 written');
  await queue.drain(1_000, new Error('test over'));
  assert.deepEqual(internals(queue), idle);
});

// ---- Property 2: a held write is never held forever ----

test('2: a backlog call that never calls callEnded (it throws) releases the held writes when its execution ends', async () => {
  // Regression: would fail without endBacklogCall() in track()'s finally (writes held until the
  // hold timer, 60 s here; backlogCalls stuck at 1).
  const written: string[][] = [];
  const fail = gate();
  const called = new Set<string>();
  const { queue, writes } = queueRecordingWrites(
    {
      concurrency: 1,
      claimGraceMs: 10_000,
      run: async (run, _s, _l, callEnded) => {
        called.add(run.id);
        if (run.id === id(2)) {
          await fail.promise;
          throw new Error('settle blew up'); // "must not reject", but if it does
        }
        callEnded(true, true);
        await writes.add(run.id, true);
      },
    },
    written,
  );
  setCallTime(queue, 50);
  queue.hold(message(id(1)));
  queue.hold(message(id(2)));
  await until(() => called.has(id(2)), 'run 2 (waited for its slot) in its call');
  await sleep(10);
  assert.equal(written.length, 0, 'run 1 held while run 2 calls');
  fail.open();
  await until(() => written.flat().includes(id(1)), 'run 1 written once run 2 has ended', 500);
  await queue.drain(1_000, new Error('test over'));
  assert.deepEqual(internals(queue), idle);
});

test('2: a drain releases writes held for backlog calls still in flight', async () => {
  // Regression: would fail if callsUnderway() stopped ignoring backlog calls while draining.
  const written: string[][] = [];
  const long = gate();
  const called = new Set<string>();
  const { queue, writes } = queueRecordingWrites(
    {
      concurrency: 1,
      claimGraceMs: 10_000,
      run: async (run, signal, _l, callEnded) => {
        called.add(run.id);
        if (run.id === id(2))
          await Promise.race([long.promise, new Promise((r) => signal.addEventListener('abort', r))]);
        callEnded(true, true);
        await writes.add(run.id, true);
      },
    },
    written,
  );
  setCallTime(queue, 50);
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await until(() => called.has(id(2)), 'run 2 in its call, run 3 waiting for a slot');
  await sleep(10);
  assert.equal(written.length, 0);
  await drainSendsHeldWrite(queue, written, id(1), long.open);
  assert.deepEqual(internals(queue), { ...idle, backlog: internals(queue).backlog });
  assert.equal(internals(queue).backlogCalls, 0);
});

test("1/2: a backlog call superseded by the poller's execute() is counted until it ends; the poller's own call holds nothing", async () => {
  // Regression: would fail if a superseded execution's decrement were lost (isTracked false in
  // callEnded, or the finally skipped for superseded), or counted twice (negative count).
  const written: string[][] = [];
  const stale = gate();
  const called: string[] = [];
  const { queue, writes } = queueRecordingWrites(
    {
      concurrency: 2,
      claimGraceMs: 10_000,
      run: async (run, signal, _l, callEnded) => {
        called.push(`${run.id}#${run.attempt}`);
        if (run.id === id(3) && run.attempt === 1) {
          // Aborted (claim lost) but winds down slowly, without calling callEnded.
          await new Promise((r) => signal.addEventListener('abort', r));
          await stale.promise;
          return;
        }
        if (run.id === id(3)) await sleep(5);
        callEnded(true, true);
        await writes.add(`${run.id}#${run.attempt}`, true);
      },
    },
    written,
  );
  setCallTime(queue, 50);
  // Run 1 long enough that run 3 waits for a slot.
  queue.hold(message(id(1)));
  queue.hold(message(id(2)));
  queue.hold(message(id(3)));
  await until(() => called.includes(`${id(3)}#1`), 'run 3 (a backlog call) in its call');
  assert.equal(internals(queue).backlogCalls >= 1, true);
  const release = queue.reserve(1);
  queue.execute(fakeClaimedRun(id(3), 2)); // its claim expired and the poller took it again
  release();
  await until(() => called.includes(`${id(3)}#2`), "the poller's call");
  await sleep(20);
  assert.ok(internals(queue).backlogCalls >= 0);
  assert.equal(internals(queue).superseded, 1);
  assert.equal(internals(queue).backlogCalls, internals(queue).flagged, 'count matches the flags');
  stale.open();
  await until(() => written.flat().length === 3, 'every write once the superseded call has ended', 500);
  await queue.drain(1_000, new Error('test over'));
  assert.deepEqual(internals(queue), idle);
});

// ---- Properties 1 and 5: counters under random interleavings ----

test('1/5: random interleavings (callEnded missing, twice, late; reholds; supersedes; aborted waits; drain) keep the counts consistent and return them to 0', async () => {
  let seed = 7;
  const rnd = () => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
  let inCall = 0;
  let maxInCall = 0;
  const violations: string[] = [];
  const late: (() => void)[] = [];
  const concurrency = 3;
  const wiring: { queue: RunQueue; writes: MicroBatcher<string, boolean> } = queueWithHeldWrites<string>(
    {
      concurrency,
      claimGraceMs: 2_000,
      writesHeld: (): number => {
        const s = internals(queue);
        if (s.backlogCalls < 0) violations.push(`backlogCalls ${s.backlogCalls}`);
        if (s.backlogCalls !== s.flagged)
          violations.push(`backlogCalls ${s.backlogCalls} != flagged ${s.flagged}`);
        if (s.backlogCalls > s.slotted + s.ahead)
          violations.push(`backlogCalls ${s.backlogCalls} > executions`);
        if (s.settling > s.slotted) violations.push(`settling ${s.settling} > slotted ${s.slotted}`);
        if (s.ahead < 0 || s.slotted < 0) violations.push(`ahead ${s.ahead} slotted ${s.slotted}`);
        return writes.held;
      },
      claim: async (request) => {
        await sleep(Math.floor(rnd() * 3));
        const r = rnd();
        if (r < 0.05) return { kind: 'rehold', notBefore: new Date(Date.now() + 3) };
        if (r < 0.08) return { kind: 'done' };
        return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
      },
      run: async (run, signal, _l, callEnded) => {
        if (signal.aborted) return callEnded(false);
        inCall += 1;
        maxInCall = Math.max(maxInCall, inCall);
        await Promise.race([
          sleep(Math.floor(rnd() * 6)),
          new Promise((r) => signal.addEventListener('abort', r)),
        ]);
        inCall -= 1;
        const r = rnd();
        if (r < 0.1) return; // never calls callEnded
        if (r < 0.15) late.push(() => callEnded(true, true));
        callEnded(true, true);
        if (r < 0.25) callEnded(true, true); // twice
        if (r < 0.3) throw new Error('blew up');
        await writes.add(`${run.id}#${run.attempt}`, rnd() < 0.8);
      },
    },
    async (items) => {
      await sleep(Math.floor(rnd() * 3));
      return items.map(() => true);
    },
  );
  const { queue, writes } = wiring;
  setCallTime(queue, 5);
  const total = 150;
  for (let n = 1; n <= total; n++) {
    queue.hold(message(id(n)));
    if (rnd() < 0.15) await sleep(Math.floor(rnd() * 4));
    if (rnd() < 0.05) {
      // The poller takes a run again (superseding an execution still here, or not).
      const free = queue.freeSlots();
      if (free > 0) {
        const release = queue.reserve(1);
        queue.execute(fakeClaimedRun(id(1 + Math.floor(rnd() * n)), 2));
        release();
      }
    }
    if (rnd() < 0.1) for (const f of late.splice(0)) f();
  }
  await sleep(100);
  // The drain aborts whatever is still waiting for its time or a slot.
  await queue.drain(2_000, new Error('test over'));
  for (const f of late.splice(0)) f();
  await until(() => writes.held === 0, 'nothing held');
  assert.deepEqual(violations.slice(0, 5), []);
  assert.ok(maxInCall <= concurrency + 1, `calls at once ${maxInCall}`); // +1: a poller's reserved slot
  const s = internals(queue);
  assert.deepEqual({ ...s, backlog: false }, idle);
});

test('5: slot accounting is the same as before: backlog calls take no extra slot and give theirs back when their call ends', async () => {
  // Regression for property 5: busy()/freeSlots() and settling with backlog calls, 1 slot, a
  // herd of 3 claimed ahead whose writes are held: each call ends and its slot goes to the next.
  const written: string[][] = [];
  const order: string[] = [];
  let inCall = 0;
  let maxInCall = 0;
  const { queue, writes } = queueRecordingWrites(
    {
      concurrency: 1,
      claimGraceMs: 10_000,
      run: async (run, _s, _l, callEnded) => {
        inCall += 1;
        maxInCall = Math.max(maxInCall, inCall);
        order.push(run.id);
        await sleep(3);
        inCall -= 1;
        callEnded(true, true);
        await writes.add(run.id, true);
      },
    },
    written,
  );
  setCallTime(queue, 50);
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
  await until(() => order.length === 3, 'all three called without waiting for the held writes', 500);
  await until(() => written.flat().length === 3, 'all written once the herd has ended', 500);
  assert.equal(maxInCall, 1);
  assert.deepEqual(order, [id(1), id(2), id(3)]);
  assert.equal(queue.freeSlots(), 1);
  await queue.drain(1_000, new Error('test over'));
  assert.deepEqual(internals(queue), idle);
});

// ---- Second review: violations found (each fails on b756767) ----

test('R2/3: a herd whose one extra run waited only in slotWaiters holds writes for a run claimed while its granted call is underway', async () => {
  // 2 slots, 3 runs claimed ahead and due at once: runs 1 and 2 take the slots, run 3 waits in
  // slotWaiters (pushed outside pump(): `backlog` is not set). Run 1 ends and its pump grants run 3
  // (a backlog call) and ends with nothing waiting, so `backlog` stays false. Run 2 ends; run 4 is
  // claimed while run 3, the herd's last call, is underway: a free slot, nothing waiting, `backlog`
  // false, so run 4 is not marked, and the held writes go when run 3 ends, while run 4 calls.
  // The same herd with its extra run waiting in `ready` (test "4: a call that starts while a
  // backlog's calls are underway") holds them until run 4 has ended.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 2, claimGraceMs: 10_000 },
    [1, 2, 3, 4].map(id),
  );
  setCallTime(queue, 50);
  try {
    for (let n = 1; n <= 3; n++) queue.hold(message(id(n)));
    await until(
      () => called.has(id(1)) && called.has(id(2)) && internals(queue).waiting === 1,
      'run 3 waits for a slot',
    );
    open(id(1));
    await until(() => called.has(id(3)), 'run 3 granted');
    open(id(2));
    await until(() => internals(queue).settling === 2, 'runs 1 and 2 settling (held)');
    assert.equal(written.length, 0);
    queue.hold(message(id(4))); // claimed late, while the herd's last call is underway
    await until(() => called.has(id(4)), 'run 4 in its call');
    open(id(3)); // the herd's last call ends; run 4 has not
    await sleep(20);
    assert.equal(queue.callsUnderway(), true, 'run 4, claimed during the backlog, is part of it');
    assert.equal(written.length, 0, 'held while run 4 is in its call');
    open(id(4));
    await until(() => written.flat().length === 4, 'all written once run 4 has ended', 500);
  } finally {
    openAll();
    await queue.drain(1_000, new Error('test over'));
  }
  assert.deepEqual(internals(queue), idle);
});

test('R2/2: a waiting run superseded by a newer, not yet due announcement ends the backlog: a later lone call holds nothing', async () => {
  // 2 slots, no claims ahead of free slots, claims 1 s before not_before. Run 0: a long call
  // beside a light load. Run 1 (due in 150 ms) is claimed ahead into the free slot's budget; run 2,
  // due now, waits in `ready` for it: end of pump, `backlog` = true. Run 2's attempt 2 (a retry
  // made elsewhere, due in 60 s) replaces it: forget() empties `ready`, then update(), no pump():
  // `backlog` stays true with nothing waiting and no backlog call. 150 ms later run 1 gets the free
  // slot with nothing waiting but is marked by the stale flag, and run 0's write, when its call
  // ends, is held for its full hold (60 s here) while run 1 calls.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    {
      concurrency: 2,
      claimLeadMs: 1_000,
      claim: async (request) => ({
        kind: 'claimed',
        run: { ...fakeClaimedRun(request.runId, request.attempt), notBefore: request.notBefore },
      }),
    },
    [id(0), id(1)],
  );
  try {
    queue.hold(message(id(0)));
    await until(() => called.has(id(0)), 'run 0 (a lone long call) in its call');
    queue.hold(message(id(1), 1, new Date(Date.now() + 150)));
    queue.hold(message(id(2)));
    assert.equal(internals(queue).waiting, 1, 'run 2 waits in ready for the claim budget');
    queue.hold(message(id(2), 2, new Date(Date.now() + 60_000)));
    assert.equal(internals(queue).waiting, 0);
    assert.equal(internals(queue).backlogCalls, 0);
    assert.equal(queue.callsUnderway(), false);
    await until(() => called.has(id(1)), 'run 1 in its call');
    open(id(0));
    await until(() => written.flat().includes(id(0)), "run 0's write goes at once", 500);
    assert.equal(internals(queue).backlogCalls, 0, 'run 1 got its slot with no backlog on');
    open(id(1));
    await until(() => written.flat().length === 2, 'all written', 500);
    assert.equal(internals(queue).backlog, false);
  } finally {
    openAll();
    await queue.drain(1_000, new Error('test over'));
  }
  assert.deepEqual(internals(queue), idle);
});

// ---- The poller's reservation is not a backlog ----

test("a run that waited for a slot only while the poller's query held it reserved is not a backlog call", async () => {
  // 2 slots. Run 1 is a lone long call. The poller reserves the other slot for its query; run 2
  // (claimed ahead) falls due meanwhile and waits for it. The query finds nothing and gives the
  // slot back: run 2 gets it at once. No call waited for another call, so nothing is held: run 1's
  // write goes when its call ends, though run 2 (long too) is still calling.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 2, claimGraceMs: 10_000 },
    [id(1), id(2)],
  );
  setCallTime(queue, 50);
  try {
    queue.hold(message(id(1)));
    await until(() => called.has(id(1)), 'run 1 (a lone long call) in its call');
    const release = queue.reserve(queue.freeSlots()); // the poller's query begins
    queue.hold(message(id(2)));
    await until(() => internals(queue).waiting === 1, 'run 2 waits for the reserved slot');
    release(); // the query found nothing overdue
    await until(() => called.has(id(2)), 'run 2 in its call');
    assert.equal(queue.callsUnderway(), false, 'run 2 waited for no call');
    open(id(1));
    await until(() => written.flat().includes(id(1)), "run 1's write goes at once", 500);
    open(id(2));
    await until(() => written.flat().length === 2, 'all written', 500);
  } finally {
    openAll();
    await queue.drain(1_000, new Error('test over'));
  }
  assert.deepEqual(internals(queue), idle);
});

test('a run left waiting once the poller filled its reserved slot with a call is part of a backlog', async () => {
  // As above, but the poller's query claims an overdue run (3) into the reserved slot: run 2 now
  // waits for calls, and a success's write is held until the backlog's calls have ended.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 2, claimGraceMs: 10_000 },
    [id(1), id(2), id(3)],
  );
  setCallTime(queue, 50);
  try {
    const release = await longCallThenPoll(queue, called);
    queue.hold(message(id(2)));
    await until(() => internals(queue).waiting === 1, 'run 2 waits for the reserved slot');
    queue.execute(fakeClaimedRun(id(3), 1)); // the poller's claim takes the reserved slot
    release();
    await until(() => called.has(id(3)), "the poller's run 3 in its call");
    assert.equal(internals(queue).waiting, 1, 'run 2 still waits, now for a call to end');
    assert.equal(queue.callsUnderway(), true);
    open(id(3));
    await until(() => called.has(id(2)), "run 2 in run 3's slot");
    await sleep(20);
    assert.equal(written.length, 0, "run 3's write held while run 2, which waited for it, calls");
    open(id(2));
    await until(() => written.flat().length === 2, 'runs 2 and 3 written once the backlog is over', 500);
    open(id(1));
    await until(() => written.flat().length === 3, 'run 1 written', 500);
  } finally {
    openAll();
    await queue.drain(1_000, new Error('test over'));
  }
  assert.deepEqual(internals(queue), idle);
});

/** Invariants at each step: the backlog count matches its flags; no more calls than slots. */
function checkCounts(queue: RunQueue, concurrency: number): void {
  const c = queueCounters(queue);
  assert.equal(c.backlogCalls, c.flagged, 'backlogCalls == flagged');
  assert.ok(c.backlogCalls >= 0);
  assert.ok(c.slotted - c.settling <= concurrency + c.reserved, 'calls in flight within slots');
}

// A third review (helper-22) of the change above: with a slot reserved, a pump never ends with
// the slots full of calls, so a herd whose calls end during the poller's query started no backlog.
// A run given the slot of a call that ended waited for that call: it starts one (giveSlot).

test("helper-22 T1: a herd that waits for calls that end during the poller's query is a backlog", async () => {
  // 2 slots; run 1 a long call; the poller reserves the other slot and its query is slow (DB busy).
  // Runs 2 and 3 fall due: 3 runs for 2 slots. Run 3 waits for two calls to end (1, then 2): it
  // would have waited for run 1 even with no reservation. Its writes must be held while it calls.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 2, claimGraceMs: 10_000 },
    [id(1), id(2), id(3)],
  );
  setCallTime(queue, 50);
  let release: (() => void) | undefined;
  try {
    release = await longCallThenPoll(queue, called);
    assert.equal(internals(queue).reserved, 1);
    queue.hold(message(id(2)));
    queue.hold(message(id(3)));
    await until(() => internals(queue).waiting === 2, 'runs 2 and 3 wait');
    checkCounts(queue, 2);
    open(id(1));
    await until(() => called.has(id(2)), "run 2 in run 1's slot");
    checkCounts(queue, 2);
    open(id(2));
    await until(() => called.has(id(3)), "run 3 in run 2's slot (it waited for calls 1 and 2)");
    checkCounts(queue, 2);
    await sleep(20);
    assert.deepEqual(written, [], 'writes of 1 and 2 held while run 3, which waited for their calls, calls');
  } finally {
    openAll();
    release?.();
  }
  await endsIdle(queue, written, 3);
});

test("helper-22 T2: a run given a call's slot during the poller's query is part of the backlog", async () => {
  // 2 slots; run 1 long; poller reserves 1; runs 2, 3, 4 fall due (4 runs for 2 slots).
  // Run 1 ends during the query: run 2 gets its slot (it waited for run 1's call). The query ends
  // empty: run 3 gets the reserved slot, run 4 still waits -> backlog. Run 3 ends, run 4 (marked)
  // gets its slot and ends: writes go while run 2, which waited for run 1's call, still calls.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 2, claimGraceMs: 10_000 },
    [1, 2, 3, 4].map(id),
  );
  setCallTime(queue, 50);
  let release: (() => void) | undefined;
  try {
    release = await longCallThenPoll(queue, called);
    for (const n of [2, 3, 4]) queue.hold(message(id(n)));
    await until(() => internals(queue).waiting === 3, 'runs 2-4 wait');
    open(id(1));
    await until(() => called.has(id(2)), "run 2 in run 1's slot");
    release();
    await until(() => called.has(id(3)), 'run 3 in the released slot');
    assert.equal(internals(queue).backlog, true, 'run 4 left waiting for calls: backlog');
    open(id(3));
    await until(() => called.has(id(4)), "run 4 in run 3's slot");
    open(id(4));
    await sleep(20); // run 4's call has ended; run 2's has not
    checkCounts(queue, 2);
    assert.equal(internals(queue).slotted - internals(queue).settling, 1, 'run 2 still calling');
    assert.deepEqual(written, [], 'writes held while run 2 (waited for run 1) calls');
  } finally {
    openAll();
    release?.();
  }
  await endsIdle(queue, written, 4);
});

test('helper-22 T3: a herd on 4 slots, 1 reserved, drains during a slow poll: its writes wait for its last calls', async () => {
  // 4 slots, 3 long calls (1-3), poller reserves 1; runs 4..11 fall due (8 runs, 1 free slot).
  // Calls end one by one during the query; the last 3 herd runs call after the waiters are empty.
  const c = 4;
  const all = Array.from({ length: 11 }, (_, i) => id(i + 1));
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: c, claimGraceMs: 10_000 },
    all,
  );
  setCallTime(queue, 50);
  let release: (() => void) | undefined;
  try {
    for (const n of [1, 2, 3]) queue.hold(message(id(n)));
    await until(() => called.size === 3, 'runs 1-3 calling');
    release = queue.reserve(queue.freeSlots());
    for (let n = 4; n <= 11; n++) queue.hold(message(id(n)));
    await until(() => internals(queue).waiting === 8, 'the herd waits');
    // End calls in slot order until nothing waits.
    let next = 1;
    while (internals(queue).waiting > 0) {
      open(id(next));
      next += 1;
      await until(() => called.size >= next + 2, 'next herd run calling');
      checkCounts(queue, c);
    }
    // Runs 9, 10, 11 (and 8) are calling; the herd waited for calls throughout.
    await sleep(20);
    assert.equal(queue.callsUnderway(), true, "the herd's last calls are underway");
    assert.deepEqual(written, [], 'writes held while the herd calls');
  } finally {
    openAll();
    release?.();
  }
  await endsIdle(queue, written, 11);
});

test('helper-22 T4: the poller claims a run into part of its reservation; the run given the rest holds nothing', async () => {
  // 3 slots; run 1 long; poller reserves 2; run 2 waits. Poller claims run 3 into one reserved
  // slot; release gives run 2 the other. No run waited for a call: nothing held.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 3, claimGraceMs: 10_000 },
    [1, 2, 3].map(id),
  );
  setCallTime(queue, 50);
  try {
    const release = await longCallThenPoll(queue, called);
    assert.equal(internals(queue).reserved, 2);
    queue.hold(message(id(2)));
    await until(() => internals(queue).waiting === 1, 'run 2 waits');
    queue.execute(fakeClaimedRun(id(3), 1));
    release();
    await until(() => called.has(id(2)) && called.has(id(3)), 'runs 2 and 3 calling');
    checkCounts(queue, 3);
    assert.equal(queue.callsUnderway(), false);
    assert.equal(internals(queue).backlogCalls, 0);
    open(id(1));
    await until(() => written.flat().includes(id(1)), "run 1's write goes at once", 500);
  } finally {
    openAll();
  }
  await endsIdle(queue, written, 3);
});

// A fourth review (helper-23): a run can also wait in `ready`, for the claim budget, which counts
// the reserved slots as taken; with no claims ahead of the free slots (long calls, or the tests'
// claimGraceMs 0) waiting there only for the poller's query started a backlog too.

for (const [settings, callMs] of [
  [{ concurrency: 2 }, undefined],
  [{ concurrency: 2, claimGraceMs: 5_000 }, 10_000],
] as const) {
  test(`helper-23 A: a run that waited in \`ready\` only for the poller's reservation holds nothing (${JSON.stringify(settings)})`, async () => {
    const { queue, written, called, open, openAll } = queueWithGatedCalls(settings, [id(1), id(2)]);
    if (callMs) setCallTime(queue, callMs); // calls of 10 s: no claims ahead of the free slots
    try {
      queue.hold(message(id(1)));
      await until(() => called.has(id(1)), 'run 1 (a lone long call) in its call');
      const release = queue.reserve(queue.freeSlots());
      queue.hold(message(id(2)));
      assert.equal(
        queueCounters(queue).ready,
        1,
        'run 2 waits in ready: the reservation took the claim budget',
      );
      release(); // the query found nothing
      await until(() => called.has(id(2)), 'run 2 in its call');
      assert.equal(queue.callsUnderway(), false, 'run 2 waited for no call');
      open(id(1));
      await until(() => written.flat().includes(id(1)), "run 1's write goes at once", 500);
    } finally {
      openAll();
    }
    await until(() => written.flat().length === 2, 'all written');
    await queue.drain(1_000, new Error('test over'));
    assert.deepEqual(internals(queue), idle);
  });
}

test("helper-23 G: a run waiting for the reserved slot and one in `ready` behind it, both given the reservation's slots, hold nothing", async () => {
  // 3 slots, claims ahead for 1 run beyond the free slots (1 s grace, 1.5 s calls). Run 1 calls;
  // the poller reserves the 2 free slots; run 2 is claimed ahead and waits for a slot, run 3 waits
  // in `ready`. The query finds nothing: runs 2 and 3 get the two slots, having waited for no call.
  const { queue, written, called, open, openAll } = queueWithGatedCalls(
    { concurrency: 3, claimGraceMs: 1_000 },
    [1, 2, 3].map(id),
  );
  setCallTime(queue, 1_500);
  try {
    const release = await longCallThenPoll(queue, called);
    queue.hold(message(id(2)));
    queue.hold(message(id(3)));
    await until(() => queueCounters(queue).slotWaiters === 1, 'run 2 claimed, waiting for a slot');
    assert.equal(queueCounters(queue).ready, 1, 'run 3 waits in ready');
    release();
    await until(() => called.has(id(2)) && called.has(id(3)), 'runs 2 and 3 in their calls');
    checkCounts(queue, 3);
    assert.equal(queue.callsUnderway(), false);
    open(id(1));
    await until(() => written.flat().includes(id(1)), "run 1's write goes at once", 500);
  } finally {
    openAll();
  }
  await endsIdle(queue, written, 3);
});
