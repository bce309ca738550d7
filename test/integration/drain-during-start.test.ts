import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { runAttempt, WorkerStoppingError, type AttemptContext } from '../../src/execution/attempt.js';
import { createStartBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { RunQueue } from '../../src/execution/run-queue.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, releaseClaim, type AttemptReport } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { claimRuns, type ClaimedRun, type StartAnswer } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { waitFor } from '../support/execution.js';

// A stopping worker calls a run only if the call can end (its timeout) before the drain's deadline
// (attempt.ts whyNotStart, drainLeftMs); otherwise the drain would cut the call, which may have
// reached the target, and the run would be called again by the worker it is handed to. A drain
// that begins after the run queue gave a run claimed ahead to runAttempt, while its START is on
// its way, applies to it too. Real PostgreSQL, the real run queue, start batcher and runAttempt,
// as worker.ts wires them; the executor records calls instead of making them.

let db: TestDatabase;
const TOLERANCE_MS = 10;

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** An enabled job and one queued run of it due `inMs` from now (database clock, whole ms). */
async function jobWithRun(inMs: number): Promise<{ jobId: string; message: RunMessage }> {
  const { rows } = await db.pool.query<{ jobId: string; id: string; at: Date }>(
    `WITH j AS (
       INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
       VALUES ('lead-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3,
               'allow', now() + interval '1 hour') RETURNING *)
     INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, t, 'queued', 3, j.target, j.timeout_ms, 100, 2, 'allow', t
     FROM j, (SELECT date_trunc('milliseconds', clock_timestamp()) + $1::int * interval '1 millisecond' AS t) s
     RETURNING runs.job_id AS "jobId", runs.id, runs.scheduled_for AS at`,
    [inMs],
  );
  const { jobId, id, at } = rows[0]!;
  return {
    jobId,
    message: {
      runId: id,
      jobId,
      attempt: 1,
      scheduledFor: at,
      notBefore: at,
      timeoutMs: 1000,
      concurrency: 'allow',
    },
  };
}

interface Node {
  queue: RunQueue;
  /** When each call began, ms after its run's not_before by this node's estimate (negative: early). */
  calls: { runId: string; lateMs: number }[];
  handedOff: RunMessage[];
}

/**
 * A worker's run queue and attempts on the test database, wired as worker.ts wires them (claim
 * lead, the start batcher with the tolerance). `afterStart` runs once
 * START has answered, before runAttempt goes on: what lands between START and the call. Each call
 * takes `callMs` unless cut.
 */
async function node(
  nodeId: string,
  afterStart: (run: ClaimedRun, answer: StartAnswer, queue: RunQueue) => Promise<void> = async () =>
    undefined,
  callMs = 1,
): Promise<Node> {
  const clock = new DbClock();
  await clock.sync(db.pool);
  const metrics = createMetrics('test');
  const starts = createStartBatcher(db.pool, nodeId, TOLERANCE_MS);
  const calls: Node['calls'] = [];
  const handedOff: RunMessage[] = [];
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
      calls.push({ runId: run.id, lateMs: clock.now() - run.notBefore.getTime() });
      // The target answers after `callMs`, unless the call is cut first (it has reached the target).
      const cut = await sleep(callMs, false, { signal: cancel }).catch(() => true);
      if (cut) {
        return {
          outcome: 'cancelled',
          statusCode: null,
          durationMs: null,
          error: 'aborted',
          responseExcerpt: null,
        };
      }
      return {
        outcome: 'succeeded',
        statusCode: 200,
        durationMs: callMs,
        error: null,
        responseExcerpt: null,
      };
    },
  } as unknown as HttpExecutor;
  const ctx: AttemptContext = {
    pool: db.pool,
    nodeId,
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock,
    start: async (run) => {
      const answer = await starts.add({ id: run.id, attempt: run.attempt });
      await afterStart(run, answer, queue);
      return answer;
    },
    complete: (run, report) => completeSucceeded(db.pool, run, nodeId, report),
    release: (run, report) => inTransaction(db.pool, (c) => releaseClaim(c, run, nodeId, report, 'runs')),
    handOff: (messages) => handedOff.push(...messages),
    logger: silentLogger,
    metrics,
  };
  const queue: RunQueue = new RunQueue({
    claim: async (message) => {
      const [run] = await claimRuns(db.pool, [{ runId: message.runId, expectedAttempt: message.attempt }], {
        nodeId,
        graceMs: 5000,
        skewToleranceMs: TOLERANCE_MS,
        leadMs: 750,
      });
      return run ? { kind: 'claimed', run } : { kind: 'done' };
    },
    claimLeadMs: 750,
    claimGraceMs: 5000,
    concurrency: 4,
    prefetch: 100,
    clock,
    run: (run, signal, drainLeftMs, callEnded, untilSlot) =>
      runAttempt(ctx, run, signal, drainLeftMs, callEnded, untilSlot),
    handOff: (messages) => handedOff.push(...messages),
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics,
  });
  return { queue, calls, handedOff };
}

test('a drain that begins while a run’s START is on its way: a call that could not end before the deadline is not made', async () => {
  const { message } = await jobWithRun(1200);
  let drained: Promise<void> | undefined;
  const a = await node(
    'node-a',
    async (_run, _answer, queue) => {
      drained = queue.drain(300, new WorkerStoppingError('worker is stopping'));
    },
    1000,
  );
  a.queue.hold(message);
  await waitFor('the drain', () => drained !== undefined, 3000, 5);
  await drained;
  assert.deepEqual(a.calls, [], 'a call with a 1 s timeout began with 300 ms left, and the drain cut it');
  assert.equal(a.handedOff.length, 1, 'handed back to the other workers');
});
