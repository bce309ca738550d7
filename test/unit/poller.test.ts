import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { DbClock } from '../../src/execution/db-clock.js';
import { pollOverdue } from '../../src/execution/poller.js';
import { RunQueue } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { dueAnnouncement, stalledPoll, testRunQueue } from '../support/run-queue.js';

// The polling fallback and the run queue share the worker's execution slots. Pure logic: the
// claims are fakes (the SQL is tested in test/integration/execution-claims.test.ts).

const CONCURRENCY = 2;
const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

function claimed(runId: string): ClaimedRun {
  return fakeClaimedRun(runId);
}

test('runs the poller claimed take the slots it reserved: announced runs due meanwhile wait, concurrency holds', async () => {
  let running = 0;
  let most = 0;
  let finish!: () => void;
  const finished = new Promise<void>((resolve) => (finish = resolve));
  const clock = new DbClock();
  const metrics = createMetrics('test');
  const queue = new RunQueue({
    claim: async (message) => ({ kind: 'claimed', run: claimed(message.runId) }),
    claimLeadMs: 0,
    claimGraceMs: 0,
    concurrency: CONCURRENCY,
    prefetch: 100,
    clock,
    run: async () => {
      running += 1;
      most = Math.max(most, running);
      await finished;
      running -= 1;
    },
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics,
  });
  // Two announced runs fall due while the poll's claim is in flight (its slots are reserved).
  const soon = new Date(Date.now() + 30);
  for (const n of [1, 2]) {
    const message: RunMessage = {
      runId: id(n),
      jobId: id(n),
      attempt: 1,
      scheduledFor: soon,
      notBefore: soon,
    };
    queue.hold(message);
  }
  const abort = new AbortController();
  let polls = 0;
  const poller = pollOverdue({
    claimOverdue: async (_overdueMs, limit) => {
      polls += 1;
      if (polls > 1) return { claimed: [], skipped: 0, misfired: 0 };
      await sleep(100);
      return { claimed: [3, 4].slice(0, limit).map((n) => claimed(id(n))), skipped: 0, misfired: 0 };
    },
    syncClock: async () => undefined,
    intervalMs: 10_000,
    overdueMs: 2000,
    capacity: () => queue.freeSlots(),
    reserve: (n) => queue.reserve(n),
    execute: (runs) => runs.forEach((run) => queue.execute(run)),
    logger: silentLogger,
    metrics,
    signal: abort.signal,
  });
  try {
    await sleep(200);
    assert.equal(polls >= 1 && running, CONCURRENCY, 'the slots are all in use');
    assert.equal(most, CONCURRENCY, `at most ${CONCURRENCY} runs execute at once`);
  } finally {
    finish();
    abort.abort();
    await poller;
    await queue.drain(1000, new Error('test over'));
  }
});

test('a poll that does not answer holds the slots no longer than its reservation lasts; its claims, when they come, wait for slots', async () => {
  let running = 0;
  let most = 0;
  const calledAt = new Map<string, number>();
  let finish!: () => void;
  const finished = new Promise<void>((resolve) => (finish = resolve));
  const queue = testRunQueue({
    concurrency: CONCURRENCY,
    run: async (run, _signal, _drainLeft, callEnded) => {
      calledAt.set(run.id, performance.now());
      running += 1;
      most = Math.max(most, running);
      await finished;
      running -= 1;
      callEnded(true);
    },
  });
  // The first poll's statement waits on a connection gone silent; it answers only when told.
  const began = performance.now();
  const poll = stalledPoll(
    queue,
    [3, 4].map((n) => claimed(id(n))),
    100,
  );
  try {
    await sleep(20);
    // An announced run falls due while the poll waits: it is called once the reservation lapses.
    queue.hold(dueAnnouncement(id(1)));
    await sleep(400);
    const called = calledAt.get(id(1));
    assert.ok(called !== undefined, 'the announced run was called while the poll was still waiting');
    assert.ok(called - began < 300, `called ${Math.round(called - began)} ms after the poll began`);
    // The poll answers at last: one of its runs takes the slot left, the other waits for one.
    poll.answer();
    await sleep(100);
    assert.equal(running, CONCURRENCY);
    assert.equal(most, CONCURRENCY, `at most ${CONCURRENCY} runs execute at once`);
    assert.equal(calledAt.size, CONCURRENCY, 'the second of the poll’s runs waits for a slot');
  } finally {
    finish();
    poll.stop();
    poll.answer();
    await poll.done;
    await queue.drain(1000, new Error('test over'));
  }
});
