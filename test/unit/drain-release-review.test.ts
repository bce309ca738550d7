import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { runAttempt, WorkerStoppingError, type AttemptContext } from '../../src/execution/attempt.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import type { RunQueue, RunQueueOptions } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/model.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { Connections } from '../../src/store/pool-share.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { gate, queueCounters, setCallTime, testRunQueue, until } from '../support/run-queue.js';

// Review of baf27dc: drain() aborts, at its start, the executions without a slot whose call could
// not end before its deadline (callEndsBy), including those whose claim is still in flight, and
// attempt.ts hands them back (stopping) without START, the `replace` step or a call. These pin
// the interleavings around that abort: a claim in flight that comes back claimed (handed back
// before its time), or rehold (handed over, not lost); a claim in flight whose call fits (called,
// at its time); an execution holding a slot whose START is in flight (not aborted early). Fakes.

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

interface Seen {
  /** run() given a live signal: attempt.ts would START and call. */
  called: { runId: string; at: number; signal: AbortSignal }[];
  /** run() given an aborted signal: attempt.ts hands it back, no call. */
  notCalled: { runId: string; reason: unknown; drainLeftMs?: number; at: number }[];
  handedOff: RunMessage[];
}

function makeQueue(
  clock: DbClock,
  overrides: Partial<RunQueueOptions>,
  hooks: { callGate?: Promise<void> } = {},
): { queue: RunQueue; seen: Seen } {
  const seen: Seen = { called: [], notCalled: [], handedOff: [] };
  const queue = testRunQueue({
    clock,
    claimGraceMs: 10_000,
    claimLeadMs: 1_000,
    concurrency: 4,
    handOff: (messages) => seen.handedOff.push(...messages),
    run: async (run, signal, drainLeftMs, callEnded) => {
      if (signal.aborted) {
        seen.notCalled.push({
          runId: run.id,
          reason: signal.reason,
          drainLeftMs: drainLeftMs?.(),
          at: clock.now(),
        });
        callEnded(false);
        return;
      }
      seen.called.push({ runId: run.id, at: clock.now(), signal });
      // START and the call: until the gate opens or the drain's deadline aborts it.
      await Promise.race([
        hooks.callGate ?? Promise.resolve(),
        new Promise((resolve) => signal.addEventListener('abort', resolve)),
      ]);
      callEnded(true);
    },
    ...overrides,
  });
  setCallTime(queue, 50);
  return { queue, seen };
}

function message(runId: string, notBefore: Date, timeoutMs: number): RunMessage {
  return { runId, jobId: runId, attempt: 1, scheduledFor: notBefore, notBefore, timeoutMs };
}

const claimedAs = (runId: string, notBefore: Date, timeoutMs: number): ClaimedRun => ({
  ...fakeClaimedRun(runId, 1),
  notBefore,
  scheduledFor: notBefore,
  timeoutMs,
  startPending: true,
  claimExpiresAt: new Date(notBefore.getTime() + timeoutMs + 5_000),
});

test('a claim in flight when the drain begins, whose call could not end before the deadline, is handed back when it returns: before its time, never called', async () => {
  const clock = new DbClock();
  const claimGate = gate();
  const notBefore = new Date(clock.now() + 400);
  const { queue, seen } = makeQueue(clock, {
    claim: async (m) => {
      await claimGate.promise;
      return { kind: 'claimed', run: claimedAs(m.runId, notBefore, 5_000) };
    },
  });
  queue.hold(message(id(1), notBefore, 5_000));
  await until(() => queueCounters(queue).executing === 1, 'its claim to be in flight');
  const stop = new WorkerStoppingError('worker is stopping');
  const drained = queue.drain(2_000, stop);
  await sleep(30);
  claimGate.open();
  await until(() => seen.notCalled.length + seen.called.length === 1, 'run() to be given the run');
  assert.deepEqual(seen.called, [], 'no call');
  const [handed] = seen.notCalled;
  assert.equal(handed!.reason, stop, 'aborted by the drain: attempt.ts hands it back (stopping)');
  assert.ok(handed!.at < notBefore.getTime(), 'handed back before its time, not when it fell due');
  assert.ok(handed!.drainLeftMs! > 1_000, `at the drain's start (${handed!.drainLeftMs} ms left)`);
  await drained;
  assert.equal(queueCounters(queue).executing, 0);
});

test('a claim in flight when the drain begins whose call can end before the deadline is called, and not before its time', async () => {
  const clock = new DbClock();
  const claimGate = gate();
  const notBefore = new Date(clock.now() + 300);
  const { queue, seen } = makeQueue(clock, {
    claim: async (m) => {
      await claimGate.promise;
      return { kind: 'claimed', run: claimedAs(m.runId, notBefore, 200) };
    },
  });
  queue.hold(message(id(2), notBefore, 200));
  await until(() => queueCounters(queue).executing === 1, 'its claim to be in flight');
  const drained = queue.drain(2_000, new WorkerStoppingError('worker is stopping'));
  await sleep(30);
  claimGate.open();
  await drained;
  assert.deepEqual(seen.notCalled, []);
  assert.deepEqual(
    seen.called.map((c) => c.runId),
    [id(2)],
  );
  assert.ok(seen.called[0]!.at >= notBefore.getTime(), 'not called before its time');
});

test('an execution holding its slot whose START (or call) is in flight when the drain begins is not aborted before the deadline', async () => {
  const clock = new DbClock();
  const startGate = gate();
  const notBefore = new Date(clock.now() - 10); // due: takes its slot at once
  const { queue, seen } = makeQueue(
    clock,
    { claim: async (m) => ({ kind: 'claimed', run: claimedAs(m.runId, notBefore, 5_000) }) },
    { callGate: startGate.promise },
  );
  queue.hold(message(id(3), notBefore, 5_000)); // its call could not end before the deadline
  await until(() => seen.called.length === 1, 'its START to be in flight');
  const drained = queue.drain(300, new WorkerStoppingError('worker is stopping'));
  await sleep(100);
  assert.equal(seen.called[0]!.signal.aborted, false, 'a slotted execution is left to its START and call');
  startGate.open();
  await drained;
  assert.deepEqual(seen.notCalled, []);
});

test('a claim in flight aborted by the drain that comes back `rehold` (not ours yet) is handed over, not lost; one that comes back `done` leaves nothing behind', async () => {
  const clock = new DbClock();
  const claimGate = gate();
  const notBefore = new Date(clock.now() + 400);
  const { queue, seen } = makeQueue(clock, {
    claim: async (m) => {
      await claimGate.promise;
      return m.runId === id(4) ? { kind: 'rehold', notBefore } : { kind: 'done' };
    },
  });
  queue.hold(message(id(4), notBefore, 5_000));
  queue.hold(message(id(5), notBefore, 5_000));
  await until(() => queueCounters(queue).executing === 2, 'both claims in flight');
  const started = performance.now();
  const drained = queue.drain(2_000, new WorkerStoppingError('worker is stopping'));
  await sleep(30);
  claimGate.open();
  await drained;
  assert.ok(performance.now() - started < 1_000, 'the drain does not wait for its deadline');
  assert.deepEqual(seen.called, []);
  assert.deepEqual(seen.notCalled, []);
  assert.deepEqual(
    seen.handedOff.map((m) => m.runId),
    [id(4)],
    'the run still queued is handed to the other workers',
  );
  assert.equal(queueCounters(queue).executing, 0);
});

test('attempt.ts: a run the drain aborted before its call is handed back without START, the replace step or a call', async () => {
  const clock = new DbClock();
  for (const concurrency of ['allow', 'replace'] as const) {
    const run: ClaimedRun = {
      ...claimedAs(id(6), new Date(clock.now() + 500), 5_000),
      concurrency,
      startPending: concurrency === 'allow',
    };
    const did: string[] = [];
    const handedOff: RunMessage[] = [];
    const next: RunMessage = { ...message(run.id, run.notBefore, 5_000), attempt: 2 };
    const pool = {
      query: async () => {
        did.push('query'); // replaceOlderRuns
        return { rows: [] };
      },
      connect: async () => {
        throw new Error('not used');
      },
    } as unknown as Connections;
    const executor = {
      execute: async () => {
        did.push('call');
        return {
          outcome: 'cancelled',
          statusCode: null,
          durationMs: 0,
          error: 'aborted',
          responseExcerpt: null,
        };
      },
    } as unknown as HttpExecutor;
    const ctx: AttemptContext = {
      pool,
      nodeId: 'stopping',
      executor,
      topics: { runsTopic: 'r', deadLetterTopic: 'd' },
      clock,
      start: async () => {
        did.push('start');
        return true;
      },
      complete: async () => true,
      release: async (_run, report) => {
        did.push(`release:${report.error}`);
        return next;
      },
      handOff: (messages) => handedOff.push(...messages),
      logger: silentLogger,
      metrics: createMetrics('test'),
    };
    const aborted = new AbortController();
    aborted.abort(new WorkerStoppingError('worker is stopping'));
    await runAttempt(ctx, run, aborted.signal, () => 10_000);
    assert.deepEqual(
      did,
      ['release:worker stopping before this call could end; call not made'],
      `${concurrency}: only the hand-back`,
    );
    assert.deepEqual(handedOff, [next]);
  }
});
