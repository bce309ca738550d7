import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type pg from 'pg';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { createCompletionBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics, type Metrics } from '../../src/observability/metrics.js';
import {
  completeSucceeded,
  failAttempt,
  selectExpiredRuns,
  type AttemptReport,
} from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import type { Connections } from '../../src/store/pool-share.js';
import { forgiveExpiredClaims } from '../../src/store/releases.js';
import { claimRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilDbTime } from '../support/db-time.js';

// README, "A finished call is recorded": a settle write that fails is retried while the claim
// holds. When the failed try had in fact committed (its answer lost: a connection cut after
// COMMIT, a read timeout), the retry finds the claim settled, by itself. That is not a claim
// lost: the call is recorded, the run is not called again, and the worker must not count it as a
// discarded completion (helios_stale_completions_total feeds the HeliosCallsNotRecorded alert).
// The worker's batched writes retry inside the batcher (item by item after a failed batch), where
// the attempt sees no error at all, only a write that found nothing to settle. A claim the reaper
// really took back between the tries still counts.

let db: TestDatabase;
const A = 'node-a';

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

async function claimedRun(timeoutMs = 1000): Promise<ClaimedRun> {
  const { rows } = await db.pool.query<{ id: string }>(
    `WITH j AS (
       INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
       VALUES ('sl-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', $1, 3, 'allow',
               now() + interval '1 hour') RETURNING id, target, timeout_ms)
     INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, date_trunc('second', clock_timestamp()), 'queued', 3, j.target, j.timeout_ms, 100, 2,
            'allow', date_trunc('second', clock_timestamp())
     FROM j RETURNING id`,
    [timeoutMs],
  );
  const [run] = await claimRuns(db.pool, [{ runId: rows[0]!.id, expectedAttempt: null }], {
    nodeId: A,
    graceMs: 100,
    skewToleranceMs: 10,
  });
  assert.ok(run, 'claimed');
  return run;
}

const LOST = () => new Error('Connection terminated unexpectedly');

function context(
  outcome: 'succeeded' | 'failed',
  settle: Partial<Pick<AttemptContext, 'complete' | 'fail'>>,
): { ctx: AttemptContext; metrics: Metrics; calls: string[] } {
  const calls: string[] = [];
  const metrics = createMetrics('test');
  const executor = {
    execute: async (run: ClaimedRun): Promise<AttemptReport> => {
      calls.push(`${run.id}:${run.attempt}`);
      return outcome === 'succeeded'
        ? { outcome, statusCode: 200, durationMs: 1, error: null, responseExcerpt: null }
        : { outcome, statusCode: 503, durationMs: 1, error: 'HTTP 503', responseExcerpt: null };
    },
  } as unknown as HttpExecutor;
  const ctx: AttemptContext = {
    pool: db.pool,
    nodeId: A,
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock: new DbClock(),
    start: async () => true,
    complete: settle.complete ?? ((r, report) => completeSucceeded(db.pool, r, A, report)),
    ...(settle.fail ? { fail: settle.fail } : {}),
    logger: silentLogger,
    metrics,
  };
  return { ctx, metrics, calls };
}

const counted = async (metrics: Metrics) => (await metrics.staleCompletions.get()).values[0]?.value ?? 0;

async function state(id: string) {
  const { rows } = await db.pool.query<{ state: string; attempt: number; outcomes: string[] }>(
    `SELECT r.state, r.attempt, array(SELECT a.outcome FROM run_attempts a WHERE a.run_id = r.id ORDER BY a.attempt) AS outcomes
     FROM runs r WHERE r.id = $1`,
    [id],
  );
  return rows[0];
}

/** A claim far from expiry as the worker sees it, so the retry is tried whatever the test's pace. */
const lasting = (run: ClaimedRun): ClaimedRun => ({ ...run, claimExpiresAt: new Date(Date.now() + 60_000) });

test('a success whose first write committed and whose answer was lost: recorded once, not counted as discarded', async () => {
  const run = await claimedRun();
  let tries = 0;
  const { ctx, metrics, calls } = context('succeeded', {
    complete: async (r, report) => {
      tries += 1;
      const done = await completeSucceeded(db.pool, r, A, report);
      if (tries === 1) throw LOST();
      return done;
    },
  });
  await ctx.clock.sync(db.pool);
  await runAttempt(ctx, lasting(run), new AbortController().signal);
  assert.equal(tries, 2, 'the write was tried again');
  assert.deepEqual(await state(run.id), { state: 'succeeded', attempt: 1, outcomes: ['succeeded'] });
  assert.deepEqual(calls, [`${run.id}:1`]);
  assert.equal(await counted(metrics), 0, 'no completion was discarded');
});

test('a failure whose first write committed (the retry queued) and whose answer was lost: not counted as discarded', async () => {
  const run = await claimedRun();
  let tries = 0;
  const { ctx, metrics } = context('failed', {
    fail: async (r, report, delay) => {
      tries += 1;
      const result = await inTransaction(db.pool, (c) =>
        failAttempt(c, r, { nodeId: A }, report, delay, { runsTopic: 'runs', deadLetterTopic: 'dead' }),
      );
      if (tries === 1) throw LOST();
      return result;
    },
  });
  await ctx.clock.sync(db.pool);
  await runAttempt(ctx, lasting(run), new AbortController().signal);
  assert.equal(tries, 2);
  assert.deepEqual(await state(run.id), { state: 'queued', attempt: 1, outcomes: ['failed'] });
  assert.equal(await counted(metrics), 0, 'no completion was discarded');
});

test('a first write that never reached the database, the reaper taking the claim back before the retry: counted as discarded', async () => {
  const run = await claimedRun(100);
  let tries = 0;
  const { ctx, metrics } = context('succeeded', {
    complete: async (r, report) => {
      tries += 1;
      if (tries === 1) {
        await untilDbTime(db.pool, new Date(run.claimExpiresAt.getTime() + 20));
        const taken = await inTransaction(db.pool, async (c) => {
          const expired = await selectExpiredRuns(c, 100);
          const report = {
            outcome: 'expired' as const,
            statusCode: null,
            durationMs: null,
            error: 'expired',
            responseExcerpt: null,
          };
          return forgiveExpiredClaims(
            c,
            expired.filter((e) => e.id === run.id).map((e) => ({ run: e, error: report.error })),
            2,
            'runs',
          );
        });
        assert.equal(taken.filter(Boolean).length, 1, 'the reaper took the claim back');
        throw LOST();
      }
      return completeSucceeded(db.pool, r, A, report);
    },
  });
  await ctx.clock.sync(db.pool);
  await runAttempt(ctx, lasting(run), new AbortController().signal);
  assert.equal(tries, 2);
  assert.deepEqual(await state(run.id), { state: 'queued', attempt: 1, outcomes: ['expired'] });
  assert.equal(await counted(metrics), 1, 'the discarded completion is counted: the run is called again');
});

test("the worker's completion batcher: a batch that committed and lost its answer is redone item by item, which finds the runs settled; not counted as discarded", async () => {
  const runs = [await claimedRun(), await claimedRun()];
  let batches = 0;
  const pool: Connections = {
    connect: () => db.pool.connect(),
    query: (async (config: pg.QueryConfig, values?: unknown[]) => {
      if (typeof config === 'object' && config?.name === 'helios-complete-succeeded') {
        batches += 1;
        const result = await db.pool.query(config, values);
        if (batches === 1) throw LOST();
        return result;
      }
      return db.pool.query(config, values);
    }) as unknown as pg.Pool['query'],
  };
  const completions = createCompletionBatcher(pool, A);
  const { ctx, metrics, calls } = context('succeeded', {
    complete: (run, report) => completions.add({ run, report }),
  });
  await ctx.clock.sync(db.pool);
  await Promise.all(runs.map((run) => runAttempt(ctx, lasting(run), new AbortController().signal)));
  assert.ok(batches >= 2, 'the batch was redone');
  for (const run of runs) {
    assert.deepEqual(await state(run.id), { state: 'succeeded', attempt: 1, outcomes: ['succeeded'] });
  }
  assert.equal(calls.length, 2);
  assert.equal(await counted(metrics), 0, 'no completion was discarded');
});
