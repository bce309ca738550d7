import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import type { BrokerClient } from '../../src/broker/index.js';
import type { WorkerConfig } from '../../src/config/index.js';
import { DbClock } from '../../src/execution/db-clock.js';
import { RunClaimer } from '../../src/execution/run-claimer.js';
import { RunQueue } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { Worker } from '../../src/execution/worker.js';
import { parseHandOff } from '../../src/execution/run-message.js';
import { handOffRuns } from '../../src/store/handoff.js';
import type { ConcurrencyPolicy } from '../../src/model.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { Notifications } from '../../src/store/notifications.js';
import type { Connections } from '../../src/store/pool-share.js';
import type { ClaimRequest } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';

// What a stopping worker does with the runs it holds (the drain hand-over): each held run that
// falls due during the drain is either called (its call can end before the deadline) or handed to
// the other workers; a hand-off that cannot be sent does not fail the stop; a draining queue never
// resumes the Kafka intake. Fakes only: no server is reached.

const RUN_ID = '00000000-0000-4000-8000-0000000000a1';
const SKEW_MS = 10; // HELIOS_CLOCK_SKEW_TOLERANCE_MS default
const LEAD_MS = 50; // a short HELIOS_CLAIM_LEAD_MS, so the tests wait little

/**
 * A draining RunQueue driven by the real RunClaimer, whose database is faked to answer as
 * store/runs.ts's CLAIM and EXPLAIN_MISS do for one queued, never-claimed run: an `allow` run may be
 * claimed up to skew + lead before its not_before, a `forbid`/`replace` run only within the skew.
 */
async function drainHolding(concurrency: ConcurrencyPolicy) {
  const clock = new DbClock();
  const notBefore = new Date(clock.now() + 300);
  const timeoutMs = 200; // due 0.3 s into a 1.5 s drain, ends 1 s before its deadline: it fits
  const message: RunMessage = {
    runId: RUN_ID,
    jobId: RUN_ID,
    attempt: 1,
    scheduledFor: notBefore,
    notBefore,
    timeoutMs,
  };
  const claimable = () =>
    notBefore.getTime() - clock.now() <= SKEW_MS + (concurrency === 'allow' ? LEAD_MS : 0);
  const pool = {
    // explainClaimMiss: the run is still queued at attempt 0, not blocked, due in dueInMs.
    query: async () => ({
      rows: [
        { state: 'queued', attempt: 0, dueInMs: notBefore.getTime() - clock.now(), forbidBlocked: false },
      ],
    }),
    connect: async () => {
      throw new Error('not used');
    },
  } as unknown as Connections;
  const claimer = new RunClaimer({
    pool,
    claim: async (request: ClaimRequest) =>
      claimable() ? { ...fakeClaimedRun(request.runId, 1), concurrency, timeoutMs, notBefore } : 'missed',
    skewToleranceMs: SKEW_MS,
    claimLeadMs: LEAD_MS,
    clock,
    metrics: createMetrics('test'),
  });
  const called: string[] = [];
  const handedOff: RunMessage[] = [];
  const queue = new RunQueue({
    claim: (m, hold) => claimer.claim(m, hold),
    claimLeadMs: LEAD_MS,
    claimGraceMs: 0,
    concurrency: 4,
    prefetch: 100,
    clock,
    run: async (run, signal, drainLeftMs) => {
      // attempt.ts whyNotStart: made only if it can end before the drain aborts it.
      if (!signal.aborted && (drainLeftMs?.() ?? Infinity) > run.timeoutMs) called.push(run.id);
    },
    handOff: (messages) => handedOff.push(...messages),
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics: createMetrics('test'),
  });
  queue.hold(message);
  await sleep(20);
  const started = performance.now();
  await queue.drain(1500, new Error('worker is stopping'));
  return { called, handedOff, drainMs: performance.now() - started };
}

test('control: an `allow` run that falls due during the drain and fits is called by the draining worker', async () => {
  const { called, handedOff } = await drainHolding('allow');
  assert.deepEqual(called, [RUN_ID]);
  assert.deepEqual(handedOff, []);
});

for (const policy of ['forbid', 'replace'] as const) {
  test(`a \`${policy}\` run that falls due during the drain and fits is either called or handed off`, async () => {
    // Its claim ahead (claimLeadMs before not_before) misses, as it always does for forbid and
    // replace runs, and RunClaimer answers 'rehold'. A draining queue holds nothing again; it used
    // to drop the announcement there (not called, not held at the deadline, so not handed off),
    // leaving the run to another node's polling fallback, HELIOS_POLL_OVERDUE_MS late.
    const { called, handedOff, drainMs } = await drainHolding(policy);
    assert.ok(
      called.length === 1 || handedOff.some((m) => m.runId === RUN_ID),
      `neither called nor handed off (drain ended after ${Math.round(drainMs)} ms)`,
    );
  });
}

test('a hand-off that cannot be sent does not make a graceful stop fail (it is "only a hint")', async () => {
  // PostgreSQL unresponsive at stop time: the NOTIFY never answers (pg's connectionTimeoutMillis is
  // 5 s). stop() waits a little for it and then stops cleanly: a failed stop makes main.ts exit 1,
  // and the run is still queued in PostgreSQL for the other workers' polling fallback.
  const hang = new Promise<never>(() => undefined);
  const pool = {
    query: (text: unknown) =>
      typeof text === 'string' && text.includes('pg_notify') ? hang : Promise.resolve({ rows: [] }),
    connect: () => Promise.reject(new Error('database unavailable')),
  } as unknown as Connections;
  let deliver: ((payload: string) => void) | undefined;
  const notifications = {
    subscribe: (_channel: string, handler: (payload: string) => void) => {
      deliver = handler;
      return () => (deliver = undefined);
    },
    wait: (_channel: string, ms: number, signal: AbortSignal) =>
      sleep(ms, undefined, { signal }).catch(() => undefined),
  } as unknown as Notifications;
  // Nothing listens on port 1: the consumer fails to connect and the intake keeps retrying.
  const kafka: BrokerClient = {
    brokers: ['127.0.0.1:1'],
    clientId: 'drain-handoff-test',
    logger: silentLogger,
    connectionTimeoutMs: 100,
    requestTimeoutMs: 500,
  };
  const settings: WorkerConfig = {
    concurrency: 4,
    prefetch: 100,
    claimGraceMs: 5000,
    skewToleranceMs: SKEW_MS,
    claimLeadMs: LEAD_MS,
    misfireThresholdMs: 5000,
    pollIntervalMs: 60_000,
    pollOverdueMs: 2000,
    claimCheckIntervalMs: 60_000,
    maxExcerptBytes: 2048,
    completionHoldMs: 2000,
    dbConnections: 4,
  };
  const worker = new Worker({
    pool,
    kafka,
    notifications,
    nodeId: 'drain-test-node',
    runsTopic: 'helios.runs.drain-test',
    deadLetterTopic: 'helios.runs.drain-test.dlq',
    consumerGroup: 'helios.drain-test.workers',
    settings,
    drainTimeoutMs: 500,
    logger: silentLogger,
    metrics: createMetrics('drain-test-node'),
  });
  await worker.start();
  assert.ok(deliver, 'the worker subscribes to helios_handoff');
  // A run another worker handed over, due in a minute: held, and handed on by our drain.
  const due = new Date(Date.now() + 60_000).toISOString();
  deliver(
    JSON.stringify({
      runs: [{ runId: RUN_ID, jobId: RUN_ID, attempt: 1, scheduledFor: due, timeoutMs: 1000 }],
    }),
  );
  const stopped = await worker.stop().then(
    () => undefined,
    (err: unknown) => err,
  );
  assert.equal(
    stopped,
    undefined,
    `worker.stop() rejected: ${stopped instanceof AggregateError ? stopped.errors.map((e: Error) => e.message).join('; ') : String(stopped)}`,
  );
});

test('a draining queue never asks the Kafka intake to resume fetching', async () => {
  // worker.ts wires onBackpressure(false) to intake.resume(). A worker stopped while back-pressured
  // (held >= prefetch, the intake paused) forgets its held runs in drain()'s first pass (with the
  // defaults, 30 s timeout and 9 s drain, all of them). Were the intake resumed then, the consumer
  // could hand a fetched message to accept() before the intake's stop reaches it; hold() drops it
  // (draining) and its offset is committed: neither held, handed off, nor re-delivered.
  const clock = new DbClock();
  const signals: { full: boolean; draining: boolean }[] = [];
  let draining = false;
  const queue = new RunQueue({
    claim: async () => ({ kind: 'done' }),
    claimLeadMs: LEAD_MS,
    claimGraceMs: 0,
    concurrency: 4,
    prefetch: 2,
    clock,
    run: async () => undefined,
    handOff: () => undefined,
    onBackpressure: (full) => signals.push({ full, draining }),
    logger: silentLogger,
    metrics: createMetrics('test'),
  });
  const at = new Date(clock.now() + 60_000);
  for (const n of [1, 2]) {
    const runId = `00000000-0000-4000-8000-00000000000${n}`;
    queue.hold({ runId, jobId: runId, attempt: 1, scheduledFor: at, notBefore: at, timeoutMs: 30_000 });
  }
  assert.deepEqual(signals, [{ full: true, draining: false }], 'back-pressured before the stop');
  draining = true;
  await queue.drain(200, new Error('worker is stopping'));
  assert.deepEqual(
    signals.filter((s) => s.draining && !s.full),
    [],
    'the draining queue told the intake to resume fetching',
  );
});

test('hand-offs are addressed to the other workers in turn, in payloads PostgreSQL accepts', async () => {
  const sent: string[] = [];
  const db = {
    query: async (_text: string, params: unknown[]) => {
      sent.push(...(params[0] as string[]));
      return { rows: [] };
    },
  } as unknown as Connections;
  const at = new Date().toISOString();
  const messages = Array.from({ length: 100 }, (_, i) => {
    const runId = `00000000-0000-4000-8000-${String(i).padStart(12, '0')}`;
    return {
      runId,
      jobId: runId,
      attempt: 1,
      scheduledFor: new Date(at),
      notBefore: new Date(at),
      timeoutMs: 30_000,
    };
  });
  await handOffRuns(db, messages, ['w1', 'w2']);
  assert.ok(sent.length > 2, 'split into several payloads');
  for (const payload of sent)
    assert.ok(Buffer.byteLength(payload) < 8000, `${Buffer.byteLength(payload)} bytes`);
  const w1 = sent.flatMap((p) => parseHandOff(p, 'w1')).map((m) => m.runId);
  const w2 = sent.flatMap((p) => parseHandOff(p, 'w2')).map((m) => m.runId);
  assert.equal(w1.length, 50);
  assert.equal(w2.length, 50);
  assert.deepEqual(
    [...w1, ...w2].sort(),
    messages.map((m) => m.runId).sort(),
    'each run to exactly one worker',
  );
  // No peer known: every worker gets every run.
  sent.length = 0;
  await handOffRuns(db, messages.slice(0, 3), []);
  assert.equal(sent.flatMap((p) => parseHandOff(p, 'anyone')).length, 3);
});
