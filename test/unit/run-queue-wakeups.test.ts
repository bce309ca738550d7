import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { DbClock } from '../../src/execution/db-clock.js';
import type { ClaimOutcome, HoldState } from '../../src/execution/run-claimer.js';
import { RunQueue, type RunQueueOptions } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { MovableClock, testRunQueue, until } from '../support/run-queue.js';

// Runs held for the same instant share one wake-up (one timer, one pump): the interleavings a
// review tried against it. Fakes only. The last two failed on the first version: a run held after
// the clock estimate moved forward waited for the timer armed under the old estimate, and a
// hold() re-entered from onBackpressure left an entry in a wake-up that `held` no longer mapped
// (a run claimed ~2 s early).

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

function message(runId: string, notBefore: Date, attempt = 1, concurrency?: 'forbid'): RunMessage {
  return {
    runId,
    jobId: runId,
    attempt,
    scheduledFor: notBefore,
    notBefore,
    ...(concurrency && { concurrency }),
  };
}

interface Held {
  message: RunMessage;
  wakeAt?: number;
  early: boolean;
}

interface Internals {
  held: Map<string, Held>;
  wakeups: Map<number, { timer: NodeJS.Timeout; entries: Set<Held> }>;
  ready: { toArray(): string[] };
  executing: Map<string, unknown>;
}

const internals = (queue: RunQueue) => queue as unknown as Internals;

/** Node marks a Timeout destroyed once it has fired or been cleared: alive, it keeps the process up. */
const alive = (timer: NodeJS.Timeout) => !(timer as unknown as { _destroyed: boolean })._destroyed;

/**
 * The queue's bookkeeping of held runs: each is either in `ready` (once) or in the wake-up of its
 * instant (and only there), every wake-up entry is the one `held` maps its run to, no wake-up is
 * empty and each has a live timer.
 */
function assertConsistent(queue: RunQueue, when: string): void {
  const q = internals(queue);
  const inWakeups = new Set<Held>();
  for (const [at, wakeup] of q.wakeups) {
    assert.ok(wakeup.entries.size > 0, `${when}: empty wake-up at ${at}`);
    assert.ok(alive(wakeup.timer), `${when}: wake-up at ${at} without a timer`);
    for (const entry of wakeup.entries) {
      const runId = entry.message.runId;
      assert.equal(
        q.held.get(runId),
        entry,
        `${when}: wake-up at ${at} holds an entry of ${runId} that held does not map`,
      );
      assert.equal(entry.wakeAt, at, `${when}: ${runId} is in the wake-up at ${at} but says ${entry.wakeAt}`);
      assert.ok(!inWakeups.has(entry), `${when}: ${runId} in two wake-ups`);
      inWakeups.add(entry);
    }
  }
  const ready = q.ready.toArray();
  assert.equal(new Set(ready).size, ready.length, `${when}: a run twice in ready`);
  for (const runId of ready) {
    const entry = q.held.get(runId);
    assert.ok(entry, `${when}: ${runId} ready but not held`);
    assert.equal(entry.wakeAt, undefined, `${when}: ${runId} both ready and in a wake-up`);
  }
  for (const [runId, entry] of q.held) {
    assert.ok(
      inWakeups.has(entry) || ready.includes(runId),
      `${when}: ${runId} held, neither ready nor waiting`,
    );
  }
}

interface Claim {
  runId: string;
  attempt: number;
  early: boolean;
  /** Database clock (the queue's estimate) at the claim minus the instant it waited for: >= 0. */
  lateMs: number;
}

/**
 * A queue whose claims are recorded with how late they came by the clock estimate (never negative,
 * or the run was claimed before its time); `outcome` decides each claim (default: done).
 */
function harness(
  overrides: Partial<RunQueueOptions> & { clock: DbClock },
  outcome: (message: RunMessage, hold: HoldState) => ClaimOutcome = () => ({ kind: 'done' }),
) {
  const claims: Claim[] = [];
  const leadMs = overrides.claimLeadMs ?? 0;
  const queue = testRunQueue({
    claim: async (request, hold) => {
      const at = request.notBefore.getTime() - (hold.early ? leadMs : 0);
      claims.push({
        runId: request.runId,
        attempt: request.attempt,
        early: hold.early,
        lateMs: overrides.clock.now() - at,
      });
      return outcome(request, hold);
    },
    concurrency: 4,
    run: async (_run, _signal, _left, callEnded) => callEnded(false),
    ...overrides,
  });
  return { queue, claims };
}

// ---------------------------------------------------------------------------------------------
// Part 1: interleavings that hold (regression tests)
// ---------------------------------------------------------------------------------------------

test('a re-sync moving the clock estimate back between arm and wake: the run waits again, and is claimed at its instant', async () => {
  const clock = new MovableClock();
  const { queue, claims } = harness({ clock });
  const due = new Date(clock.now() + 80);
  queue.hold(message(id(1), due));
  queue.hold(message(id(2), due));
  const firstTimer = internals(queue).wakeups.get(due.getTime())!.timer;
  clock.shiftMs = -120; // the timer fires 120 ms early by the new estimate
  await until(() => !alive(firstTimer), 'the first timer fired');
  // Fired early by the new estimate: both wait again, together, in a new wake-up for the same instant.
  assert.equal(claims.length, 0, 'nothing claimed before its instant');
  assert.equal(internals(queue).wakeups.size, 1);
  assert.equal(internals(queue).wakeups.get(due.getTime())?.entries.size, 2, 'both wait again');
  assertConsistent(queue, 'after the early wake');
  await until(() => claims.length === 2, 'both claimed');
  for (const claim of claims) assert.ok(claim.lateMs >= 0, `claimed ${-claim.lateMs} ms before its instant`);
  assert.equal(internals(queue).wakeups.size, 0);
  await queue.drain(100, new Error('test over'));
});

test('runs with and without the claim lead whose instants coincide share one wake-up; each is claimed at its own instant', async () => {
  const clock = new DbClock();
  const leadMs = 100;
  const { queue, claims } = harness({ clock, claimLeadMs: leadMs });
  const instant = Math.trunc(clock.now()) + 80;
  queue.hold(message(id(1), new Date(instant + leadMs))); // allow: claimed `leadMs` ahead
  queue.hold(message(id(2), new Date(instant), 1, 'forbid')); // forbid: claimed at its time
  queue.hold(message(id(3), new Date(instant + leadMs)));
  assert.deepEqual([...internals(queue).wakeups.keys()], [instant], 'one wake-up for the three');
  // Run 3's newer attempt is due much later: it leaves the shared wake-up, the others keep its timer.
  queue.hold(message(id(3), new Date(instant + 60_000), 2));
  assert.equal(internals(queue).wakeups.get(instant)?.entries.size, 2);
  assert.equal(internals(queue).wakeups.size, 2);
  assertConsistent(queue, 'after run 3 moved');
  await until(() => claims.length === 2, 'runs 1 and 2 claimed');
  assert.deepEqual(claims.map((c) => [c.runId, c.early]).sort(), [
    [id(1), true],
    [id(2), false],
  ]);
  for (const claim of claims)
    assert.ok(claim.lateMs >= 0, `${claim.runId} claimed ${-claim.lateMs} ms early`);
  assert.deepEqual([...internals(queue).wakeups.keys()], [instant + 60_000 - leadMs]);
  const far = internals(queue).wakeups.get(instant + 60_000 - leadMs)!.timer;
  await queue.drain(100, new Error('test over'));
  assert.equal(internals(queue).wakeups.size, 0);
  assert.ok(!alive(far), 'the drain cleared the far wake-up timer');
});

test('newer attempts move a run from ready to a wake-up and back: each older one is never claimed, the newest once', async () => {
  const clock = new DbClock();
  const calls: { runId: string; open: () => void }[] = [];
  const claims: { runId: string; attempt: number }[] = [];
  const queue = testRunQueue({
    claim: async (request) => {
      claims.push({ runId: request.runId, attempt: request.attempt });
      return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
    },
    concurrency: 1, // claimGraceMs 0: no claim beyond the one free slot
    clock,
    run: async (run, _signal, _left, callEnded) => {
      await new Promise<void>((open) => calls.push({ runId: run.id, open }));
      callEnded();
    },
  });
  queue.hold(message(id(1), new Date()));
  await until(() => calls.length === 1, 'run 1 claimed and calling');
  queue.hold(message(id(2), new Date())); // due, but no budget: it stays ready
  assert.deepEqual(internals(queue).ready.toArray(), [id(2)]);
  queue.hold(message(id(2), new Date(clock.now() + 60_000), 2)); // ready → a wake-up
  assert.deepEqual(internals(queue).ready.toArray(), []);
  const timer = internals(queue).wakeups.values().next().value!.timer;
  assertConsistent(queue, 'attempt 2 waiting');
  queue.hold(message(id(2), new Date(), 3)); // the wake-up → ready again
  assert.equal(internals(queue).wakeups.size, 0);
  assert.ok(!alive(timer), 'the emptied wake-up has no timer left');
  assertConsistent(queue, 'attempt 3 ready');
  calls.shift()!.open();
  await until(() => calls.length === 1, 'run 2 claimed and calling');
  calls.shift()!.open();
  await until(() => internals(queue).executing.size === 0, 'calls over');
  assert.deepEqual(claims, [
    { runId: id(1), attempt: 1 },
    { runId: id(2), attempt: 3 },
  ]);
  await queue.drain(100, new Error('test over'));
});

test('a rehold (no lead, another instant) joins the wake-up of a run claimed ahead at that instant; a re-delivery changes nothing', async () => {
  const clock = new DbClock();
  const leadMs = 60;
  const instant = Math.trunc(clock.now()) + 120;
  let refused = false;
  const { queue, claims } = harness({ clock, claimLeadMs: leadMs }, (request) => {
    // The database says run 1 is due at `instant` (a forbid run claimed ahead, or skew).
    if (request.runId !== id(1) || refused) return { kind: 'done' };
    refused = true;
    return { kind: 'rehold', notBefore: new Date(instant) };
  });
  const announced = message(id(1), new Date(instant - 30)); // claimed ahead at instant - 90
  queue.hold(announced);
  queue.hold(message(id(2), new Date(instant + leadMs))); // claimed ahead at instant
  await until(
    () => internals(queue).wakeups.get(instant)?.entries.size === 2,
    'run 1 held again for the instant',
  );
  assert.equal(internals(queue).wakeups.size, 1, 'one wake-up for run 1 again and run 2');
  queue.hold(announced); // the same announcement re-delivered while run 1 waits again
  assert.equal(internals(queue).wakeups.get(instant)?.entries.size, 2);
  assertConsistent(queue, 'run 1 held again');
  await until(() => claims.length === 3, 'both claimed at the instant');
  await sleep(20);
  assert.deepEqual(claims.map((c) => [c.runId, c.early]).sort(), [
    [id(1), false],
    [id(1), true],
    [id(2), true],
  ]);
  for (const claim of claims)
    assert.ok(claim.lateMs >= 0, `${claim.runId} claimed ${-claim.lateMs} ms early`);
  await queue.drain(100, new Error('test over'));
});

test('a drain with runs waiting on shared wake-ups, due before and after its deadline, leaves no timer', async () => {
  const clock = new DbClock();
  const handedOff: string[] = [];
  const { queue, claims } = harness({
    clock,
    handOff: (messages) => handedOff.push(...messages.map((m) => m.runId)),
  });
  const soon = new Date(clock.now() + 40);
  const late = new Date(clock.now() + 10_000);
  for (let n = 1; n <= 3; n++) queue.hold(message(id(n), soon));
  for (let n = 4; n <= 6; n++) queue.hold(message(id(n), late));
  // Run 7's announced timeout (1 s) cannot end before the drain deadline: handed off though due soon.
  queue.hold({ ...message(id(7), soon), timeoutMs: 1_000 });
  const timers = [...internals(queue).wakeups.values()].map((w) => w.timer);
  assert.equal(timers.length, 2);
  await queue.drain(200, new Error('test over'));
  assert.deepEqual(claims.map((c) => c.runId).sort(), [id(1), id(2), id(3)]);
  assert.deepEqual(handedOff.sort(), [id(4), id(5), id(6), id(7)]);
  assert.equal(internals(queue).wakeups.size, 0);
  assert.equal(internals(queue).held.size, 0);
  assert.deepEqual(
    timers.map((t) => alive(t)),
    [false, false],
    'no wake-up timer outlives the drain',
  );
});

test('a hold longer than the longest timer is cut at MAX_TIMER_MS and waits again for the rest', (t) => {
  t.mock.timers.enable({ apis: ['setTimeout', 'Date'], now: 1_000_000 });
  const maxTimerMs = 2_147_483_647;
  // The mocked Date is the only clock that follows the mocked timers (performance.now() does not).
  const clock = new DbClock(() => Date.now());
  const { queue, claims } = harness({ clock });
  queue.hold(message(id(1), new Date(clock.now() + maxTimerMs + 10_000)));
  queue.hold(message(id(2), new Date(clock.now() + maxTimerMs + 10_000)));
  t.mock.timers.tick(maxTimerMs);
  assert.equal(claims.length, 0, 'not claimed when the cut timer fires');
  assert.equal(internals(queue).wakeups.size, 1);
  assert.equal([...internals(queue).wakeups.values()][0]!.entries.size, 2, 'both wait again, together');
  assertConsistent(queue, 'after the cut timer');
  t.mock.timers.tick(9_999);
  assert.equal(claims.length, 0);
  t.mock.timers.tick(1);
  assert.deepEqual(
    claims.map((c) => [c.runId, c.lateMs]),
    [
      [id(1), 0],
      [id(2), 0],
    ],
  );
  assert.equal(internals(queue).wakeups.size, 0);
});

test('a hold beyond the longest timer arms one timer that stays armed (Node would fire a longer one at once, every ms)', async () => {
  const clock = new DbClock();
  const { queue, claims } = harness({ clock });
  queue.hold(message(id(1), new Date(clock.now() + 30 * 24 * 3_600_000))); // 30 days: past 2^31 - 1 ms
  const [wakeup] = internals(queue).wakeups.values();
  try {
    await sleep(30);
    assert.equal(
      [...internals(queue).wakeups.values()][0]?.timer,
      wakeup!.timer,
      'the same timer, not re-armed',
    );
    assert.ok(alive(wakeup!.timer));
    assert.equal(claims.length, 0);
  } finally {
    await queue.drain(100, new Error('test over'));
  }
  assert.ok(!alive(wakeup!.timer), 'cleared by the drain');
});

test('randomised holds, newer attempts, re-deliveries, reholds, poller claims and re-syncs keep the wake-ups consistent; every run is claimed once at a time, never early', async () => {
  let seed = 0x5eed;
  const random = () => (seed = (seed * 1_103_515_245 + 12_345) % 2 ** 31) / 2 ** 31;
  const pick = <T>(items: readonly T[]) => items[Math.floor(random() * items.length)]!;
  const clock = new MovableClock();
  const leadMs = 15;
  const claiming = new Set<string>();
  const early: string[] = [];
  const twice: string[] = [];
  /** The newest attempt of each run this test announced, and the newest that was claimed or executed. */
  const announced = new Map<string, number>();
  const served = new Map<string, number>();
  const serve = (runId: string, attempt: number) =>
    served.set(runId, Math.max(served.get(runId) ?? 0, attempt));
  const queue: RunQueue = testRunQueue({
    claim: async (request, hold) => {
      const at = request.notBefore.getTime() - (hold.early ? leadMs : 0);
      if (clock.now() < at) early.push(`${request.runId}#${request.attempt} ${at - clock.now()} ms early`);
      if (claiming.has(request.runId)) twice.push(request.runId);
      claiming.add(request.runId);
      await sleep(Math.floor(random() * 4));
      claiming.delete(request.runId);
      const r = random();
      if (r < 0.2 && hold.retries < 2) {
        return { kind: 'rehold', notBefore: new Date(clock.now() + Math.floor(random() * 20)) };
      }
      serve(request.runId, request.attempt);
      if (r < 0.5) return { kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) };
      return { kind: 'done' };
    },
    claimLeadMs: leadMs,
    claimGraceMs: 60_000,
    concurrency: 1_000,
    prefetch: 10_000,
    clock,
    run: async (_run, _signal, _left, callEnded) => {
      await sleep(Math.floor(random() * 3));
      callEnded();
    },
  });
  const runs = Array.from({ length: 16 }, (_, n) => id(n + 1));
  const base = Math.trunc(clock.now());
  for (let step = 0; step < 600; step++) {
    const r = random();
    const runId = pick(runs);
    const q = internals(queue);
    if (r < 0.5) {
      // A new or newer announcement; instants on a 10 ms grid, so that runs share them.
      const attempt = (announced.get(runId) ?? 0) + (random() < 0.7 ? 1 : 0) || 1;
      const grid = Math.ceil(Math.max(base, clock.now()) / 10) * 10;
      const notBefore = new Date(grid + pick([-5, 0, 10, 15, 25, 40]));
      announced.set(runId, Math.max(announced.get(runId) ?? 0, attempt));
      queue.hold(message(runId, notBefore, attempt, random() < 0.2 ? 'forbid' : undefined));
    } else if (r < 0.6) {
      queue.hold(message(runId, new Date(clock.now() + 5), Math.max(1, (announced.get(runId) ?? 1) - 1)));
    } else if (r < 0.7) {
      clock.shiftMs += Math.floor(random() * 41) - 20; // a re-sync: the estimate moves up to 20 ms
    } else if (r < 0.78) {
      // The poller claims a run this queue holds (not one it is claiming: the database arbitrates that).
      const entry = q.held.get(runId);
      if (entry && !q.executing.has(runId)) {
        serve(runId, entry.message.attempt);
        queue.execute(fakeClaimedRun(runId, entry.message.attempt));
      }
    } else {
      await sleep(Math.floor(random() * 6));
    }
    assertConsistent(queue, `step ${step}`);
  }
  await until(
    () => internals(queue).held.size === 0 && internals(queue).executing.size === 0,
    'all claimed',
    5_000,
  );
  assertConsistent(queue, 'at the end');
  assert.equal(internals(queue).wakeups.size, 0, 'no wake-up left');
  assert.deepEqual(early, [], 'claimed before their instant');
  assert.deepEqual(twice, [], 'claimed twice at once');
  for (const [runId, attempt] of announced) {
    assert.ok(
      (served.get(runId) ?? 0) >= attempt,
      `${runId}: attempt ${attempt} announced, ${served.get(runId)} served`,
    );
  }
  await queue.drain(100, new Error('test over'));
});

// ---------------------------------------------------------------------------------------------
// Part 2: interleavings that do not hold (fail on bfe79df)
// ---------------------------------------------------------------------------------------------

test('a run held after a re-sync moved the clock estimate forward is claimed at its instant, not when the shared timer armed under the old estimate fires', async () => {
  const clock = new MovableClock();
  const { queue, claims } = harness({ clock });
  const due = new Date(clock.now() + 600);
  queue.hold(message(id(1), due)); // arms the instant's timer: 600 ms
  clock.shiftMs = 400; // a re-sync: the database clock is 400 ms further on than we thought
  // Run 2 is due in 200 ms by the estimate now. Before 05c8667 it got its own timer of 200 ms; now
  // it joins run 1's, which fires 600 ms after it was armed: 400 ms after run 2's instant.
  queue.hold(message(id(2), due));
  await until(() => claims.some((c) => c.runId === id(2)), 'run 2 claimed');
  const late = claims.find((c) => c.runId === id(2))!.lateMs;
  assert.ok(late < 150, `run 2 claimed ${Math.round(late)} ms after its instant by the clock estimate`);
  await queue.drain(100, new Error('test over'));
});

test('a newer attempt announced from onBackpressure while hold() replaces the run: no attempt is claimed before its instant', async () => {
  // onBackpressure re-entering hold() synchronously (an intake that delivers on resume(); the
  // review of 9166bae pins the same for pump()). hold() of attempt 2 forgets attempt 1, whose
  // update() resumes the intake, which delivers attempt 3: held and armed for its instant. Then the
  // outer hold() overwrites `held` with attempt 2 without forgetting attempt 3, which stays in its
  // wake-up. Before 05c8667 its timer checked `held.get(runId) === entry` and did nothing; now
  // wake() marks the run id ready and pump() claims what `held` maps: attempt 2, ~2 s early.
  const clock = new DbClock();
  const box: { queue?: RunQueue; deliver?: RunMessage } = {};
  const { queue, claims } = harness({
    clock,
    prefetch: 2,
    onBackpressure: (full) => {
      const deliver = box.deliver;
      if (!full && deliver) {
        box.deliver = undefined;
        box.queue!.hold(deliver);
      }
    },
  });
  box.queue = queue;
  const now = Math.trunc(clock.now());
  queue.hold(message(id(9), new Date(now + 60_000)));
  queue.hold(message(id(1), new Date(now + 60_000), 1)); // the prefetch is full
  box.deliver = message(id(1), new Date(now + 30), 3);
  queue.hold(message(id(1), new Date(now + 2_000), 2));
  try {
    await sleep(150);
    for (const claim of claims) {
      assert.ok(
        claim.lateMs >= 0,
        `attempt ${claim.attempt} claimed ${Math.round(-claim.lateMs)} ms before its instant`,
      );
    }
    assertConsistent(queue, 'after the re-entered hold');
  } finally {
    await queue.drain(100, new Error('test over'));
  }
});
