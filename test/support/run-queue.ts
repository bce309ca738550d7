import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { DbClock } from '../../src/execution/db-clock.js';
import { MicroBatcher, type BatchFunction } from '../../src/execution/micro-batcher.js';
import { pollOverdue } from '../../src/execution/poller.js';
import { RunQueue, type RunQueueOptions } from '../../src/execution/run-queue.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { RunMessage } from '../../src/model.js';
import { fakeClaimedRun } from './claimed-run.js';
import { waitFor } from './execution.js';

/**
 * A RunQueue for unit tests, with fakes: every claim succeeds (fakeClaimedRun), no claim lead, no
 * claims ahead of the free slots (claimGraceMs 0), 2 slots, nothing logged. `run` plays
 * attempt.ts; the rest can be overridden. `run` is given each run once it holds its slot (or its
 * signal aborted), START and call in one: a run claimed ahead, which the queue gives to attempt.ts
 * before its slot to be marked started meanwhile, waits for its slot first. With `slotFirst`
 * false, `run` gets the queue's own arguments, `untilSlot` included (start passes).
 */
export function testRunQueue(
  overrides: Partial<RunQueueOptions> & Pick<RunQueueOptions, 'run'>,
  { slotFirst = true } = {},
): RunQueue {
  const run = overrides.run;
  return new RunQueue({
    claim: async (request) => ({ kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) }),
    claimLeadMs: 0,
    claimGraceMs: 0,
    concurrency: 2,
    prefetch: 1000,
    clock: new DbClock(),
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics: createMetrics('test'),
    ...overrides,
    // Any other run holds its slot when given: called at once (a synchronous callEnded stays so).
    run: slotFirst
      ? (claimed, signal, drainLeftMs, callEnded, untilSlot) =>
          claimed.startPending
            ? untilSlot().then(() => run(claimed, signal, drainLeftMs, callEnded, untilSlot))
            : run(claimed, signal, drainLeftMs, callEnded, untilSlot)
      : run,
  });
}

/** Run `runId`'s first announcement, due at `notBefore` (default: now), with a 1 s timeout. */
export const dueAnnouncement = (runId: string, notBefore = new Date()): RunMessage => ({
  runId,
  jobId: runId,
  attempt: 1,
  scheduledFor: notBefore,
  notBefore,
  timeoutMs: 1000,
});

/** Sets a queue's call time estimate (run-queue.ts), as a node that has timed `timed` calls has it. */
export function setCallTime(queue: RunQueue, callMs: number, timed = 20): void {
  Object.assign(queue as unknown as { callMs: number; callsTimed: number }, { callMs, callsTimed: timed });
}

/** A DbClock whose estimate can be moved, as a re-sync moves it. */
export class MovableClock extends DbClock {
  shiftMs = 0;
  override now(): number {
    return super.now() + this.shiftMs;
  }
  override latestNow(): number {
    return super.latestNow() + this.shiftMs;
  }
}

/**
 * Waits until `done()` holds, polling every 2 ms (the queue's steps take a few ms); fails naming
 * `what` after `timeoutMs`.
 */
export async function until(done: () => boolean, what: string, timeoutMs = 3_000): Promise<void> {
  await waitFor(what, done, timeoutMs, 2);
}

/**
 * A test RunQueue whose runs write through a MicroBatcher wired as the worker wires its
 * completions (worker.ts, batching.ts): held while calls are underway, `writesHeld` its held
 * count, `onHold` pumps, `onCallsCaughtUp` releases. `write` plays the database (one call per
 * statement); the hold is long (60 s) by default, so a write that goes only because its hold ran
 * out shows as a timeout.
 */
export function queueWithHeldWrites<T>(
  overrides: Partial<RunQueueOptions> & Pick<RunQueueOptions, 'run'>,
  write: BatchFunction<T, boolean>,
  policy: { maxWaitMs?: number; maxWaiting?: number } = {},
): { queue: RunQueue; writes: MicroBatcher<T, boolean> } {
  const writes: MicroBatcher<T, boolean> = new MicroBatcher<T, boolean>(write, 100, 2, {
    busy: () => queue.callsUnderway(),
    maxWaitMs: policy.maxWaitMs ?? 60_000,
    maxWaiting: policy.maxWaiting ?? 1000,
    onHold: () => queue.writesHeldGrew(),
  });
  const queue: RunQueue = testRunQueue({
    writesHeld: () => writes.held,
    onCallsCaughtUp: () => writes.release(),
    ...overrides,
  });
  return { queue, writes };
}

/** A promise with its resolver, to hold a call or a write open until the test opens it. */
export function gate(): { promise: Promise<void>; open: () => void } {
  let open!: () => void;
  const promise = new Promise<void>((resolve) => (open = resolve));
  return { promise, open };
}

/** queueWithHeldWrites whose writes record each statement's run ids in `written` and succeed. */
export function queueRecordingWrites(
  overrides: Partial<RunQueueOptions> & Pick<RunQueueOptions, 'run'>,
  written: string[][],
): { queue: RunQueue; writes: MicroBatcher<string, boolean> } {
  return queueWithHeldWrites(overrides, async (ids: string[]) => {
    written.push(ids);
    return ids.map(() => true);
  });
}

/**
 * queueRecordingWrites whose runs play calls held open by the test: a run records its id in
 * `called`, runs `onCall` if given, waits for its gate if `gated` names it, ends its call and adds
 * its write. `open(runId)` ends a gated call; `openAll()` ends every one (for a `finally`).
 */
export function queueWithGatedCalls(
  overrides: Partial<RunQueueOptions>,
  gated: Iterable<string>,
  onCall?: (runId: string) => Promise<void>,
): {
  queue: RunQueue;
  writes: MicroBatcher<string, boolean>;
  written: string[][];
  called: Set<string>;
  open: (runId: string) => void;
  openAll: () => void;
} {
  const gates = new Map([...gated].map((runId) => [runId, gate()]));
  const called = new Set<string>();
  const written: string[][] = [];
  const { queue, writes } = queueRecordingWrites(
    {
      ...overrides,
      run: async (run, _signal, _left, callEnded) => {
        called.add(run.id);
        await onCall?.(run.id);
        await gates.get(run.id)?.promise;
        callEnded(true, true);
        await writes.add(run.id, true);
      },
    },
    written,
  );
  const open = (runId: string): void => {
    const g = gates.get(runId);
    if (!g) throw new Error(`no gate for run ${runId}`);
    g.open();
  };
  const openAll = (): void => {
    for (const g of gates.values()) g.open();
  };
  return { queue, writes, written, called, open, openAll };
}

/** A RunQueue's own counters (run-queue.ts), read by tests for invariants only. */
export function queueCounters(queue: RunQueue): {
  slotted: number;
  ahead: number;
  settling: number;
  reserved: number;
  executing: number;
  superseded: number;
  ready: number;
  slotWaiters: number;
  backlog: boolean;
  backlogCalls: number;
  /** Executions whose `backlogCall` is set: equal to backlogCalls. */
  flagged: number;
} {
  const q = queue as unknown as {
    slotted: number;
    ahead: number;
    settling: number;
    reserved: number;
    executing: Map<string, { backlogCall?: boolean }>;
    superseded: Set<{ backlogCall?: boolean }>;
    ready: { length: number };
    slotWaiters: { length: number };
    backlog: boolean;
    backlogCalls: number;
  };
  return {
    slotted: q.slotted,
    ahead: q.ahead,
    settling: q.settling,
    reserved: q.reserved,
    executing: q.executing.size,
    superseded: q.superseded.size,
    ready: q.ready.length,
    slotWaiters: q.slotWaiters.length,
    backlog: q.backlog,
    backlogCalls: q.backlogCalls,
    flagged: [...q.executing.values(), ...q.superseded].filter((e) => e.backlogCall).length,
  };
}

/**
 * Begins a drain and waits (500 ms at most) for `runId`'s held write to go at once; then `endCall`
 * ends the call still underway, and the drain is awaited.
 */
export async function drainSendsHeldWrite(
  queue: RunQueue,
  written: string[][],
  runId: string,
  endCall: () => void,
): Promise<void> {
  const drained = queue.drain(5_000, new Error('test over'));
  try {
    await until(() => written.flat().includes(runId), 'held write to go when the drain begins', 500);
  } finally {
    endCall();
    await drained;
  }
}

/**
 * A test RunQueue whose `run` plays attempt.ts: a run claimed ahead (`startPending(n)`, n its id's
 * last 6 digits) is marked started unless aborted (a round trip of `startMs`), then every run waits
 * for its slot and makes its call unless aborted, held open until the test ends it. `concurrency`
 * slots, claims ahead to spare (10 s grace, 50 ms calls), each run claimed with its announcement's
 * timeout. `endCalls(total)` ends calls as they begin, one every 2 ms, until `total` were made and
 * none is open, and fails after `withinMs` (a run left waiting).
 */
export function attemptPlayingQueue(options: {
  concurrency: number;
  startMs: number;
  startPending: (n: number) => boolean;
}) {
  const started: string[] = [];
  const called: string[] = [];
  const notCalled: string[] = [];
  const open: (() => void)[] = [];
  const queue: RunQueue = testRunQueue(
    {
      concurrency: options.concurrency,
      claimGraceMs: 10_000,
      claim: async (request) => ({
        kind: 'claimed',
        run: {
          ...fakeClaimedRun(request.runId),
          timeoutMs: request.timeoutMs ?? 1000,
          startPending: options.startPending(Number(request.runId.slice(-6))),
        },
      }),
      run: async (run, signal, _left, callEnded, untilSlot) => {
        if (run.startPending && !signal.aborted) {
          started.push(run.id);
          await sleep(options.startMs);
        }
        await untilSlot();
        if (signal.aborted) {
          notCalled.push(run.id);
          return callEnded(false);
        }
        called.push(run.id);
        const call = gate();
        open.push(call.open);
        await call.promise;
        callEnded(true);
      },
    },
    { slotFirst: false },
  );
  setCallTime(queue, 50);
  const endCalls = async (total: number, withinMs = 3_000) => {
    const by = performance.now() + withinMs;
    while (called.length < total || open.length > 0) {
      assert.ok(performance.now() < by, `${called.length} of ${total} calls made: runs left waiting`);
      open.shift()?.();
      await sleep(2);
    }
  };
  return { queue, started, called, notCalled, open, endCalls };
}

/** A queue's start pass bookkeeping (run-queue.ts), read for invariants only. */
export function startPassCounts(queue: RunQueue): { held: number; waiting: number } {
  const q = queue as unknown as { startPassesHeld: number; startPassWaiters: { length: number } };
  return { held: q.startPassesHeld, waiting: q.startPassWaiters.length };
}

/**
 * A polling fallback (pollOverdue) on `queue` whose first poll answers with `runs` only when
 * `answer()` is called (a statement left waiting); its reservation lapses after `reservationMaxMs`.
 */
export function stalledPoll(queue: RunQueue, runs: ClaimedRun[], reservationMaxMs = 50) {
  let answer!: () => void;
  const answered = new Promise<void>((resolve) => (answer = resolve));
  const abort = new AbortController();
  let polls = 0;
  const done = pollOverdue({
    claimOverdue: async (_overdueMs, limit) => {
      polls += 1;
      if (polls > 1) return { claimed: [], skipped: 0, misfired: 0 };
      await answered;
      return { claimed: runs.slice(0, limit), skipped: 0, misfired: 0 };
    },
    syncClock: async () => undefined,
    intervalMs: 10_000,
    overdueMs: 2000,
    capacity: () => queue.freeSlots(),
    reserve: (n) => queue.reserve(n),
    execute: (claimed, inReservedSlots) => claimed.forEach((run) => queue.execute(run, inReservedSlots)),
    reservationMaxMs,
    logger: silentLogger,
    metrics: createMetrics('test'),
    signal: abort.signal,
  });
  return { answer, stop: () => abort.abort(), done };
}
