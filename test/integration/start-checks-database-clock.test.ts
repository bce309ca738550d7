import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { runAttempt, WorkerStoppingError, type AttemptContext } from '../../src/execution/attempt.js';
import { createStartBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, type AttemptReport } from '../../src/store/attempts.js';
import { claimRuns, startRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { dbNow, untilDbTime } from '../support/db-time.js';

// A worker starts a run claimed ahead when the run is due by its estimate of the database clock.
// START checks it against the database clock itself (within the skew tolerance), so an estimate
// that ran early (a host clock stepped or slewed since its last sample) delays the call instead of
// making it early. Real PostgreSQL, the real start batcher and runAttempt; the executor records.

let db: TestDatabase;
const NODE = 'node-a';
const TOLERANCE_MS = 10;

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** A run due `inMs` from now (database clock), claimed ahead by NODE. */
async function claimedAhead(inMs: number): Promise<ClaimedRun> {
  const { rows } = await db.pool.query<{ id: string }>(
    `WITH j AS (
       INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
       VALUES ('early-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3,
               'allow', now() + interval '1 hour') RETURNING *)
     INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, t, 'queued', 3, j.target, j.timeout_ms, 100, 2, 'allow', t
     FROM j, (SELECT clock_timestamp() + $1::float8 * interval '1 millisecond' AS t) s
     RETURNING runs.id`,
    [inMs],
  );
  const [run] = await claimRuns(db.pool, [{ runId: rows[0]!.id, expectedAttempt: null }], {
    nodeId: NODE,
    graceMs: 5000,
    skewToleranceMs: TOLERANCE_MS,
    leadMs: 600_000,
  });
  assert.ok(run?.startPending, 'claimed ahead of its time');
  return run;
}

async function startedAt(id: string): Promise<Date | null> {
  const { rows } = await db.pool.query<{ startedAt: Date | null }>(
    'SELECT started_at AS "startedAt" FROM runs WHERE id = $1',
    [id],
  );
  return rows[0]!.startedAt;
}

test('START answers how long a run is still not due, and starts it once it is', async () => {
  const run = await claimedAhead(1500);
  const [early] = await startRuns(db.pool, NODE, [run], TOLERANCE_MS);
  assert.ok(typeof early === 'object', `not started: ${JSON.stringify(early)}`);
  assert.ok(early.dueInMs > 1000 && early.dueInMs <= 1500, `due in ${early.dueInMs} ms`);
  assert.equal(await startedAt(run.id), null);
  await untilDbTime(db.pool, run.notBefore.getTime() - TOLERANCE_MS);
  assert.deepEqual(await startRuns(db.pool, NODE, [run], TOLERANCE_MS), [true]);
  assert.ok((await startedAt(run.id))!.getTime() >= run.notBefore.getTime() - TOLERANCE_MS);
  // Without a tolerance (the store-level tests' START), a run starts whenever asked.
  const other = await claimedAhead(5000);
  assert.deepEqual(await startRuns(db.pool, NODE, [other]), [true]);
});

function context(calls: number[], metrics = createMetrics('test')): AttemptContext {
  const starts = createStartBatcher(db.pool, NODE, TOLERANCE_MS);
  const executor = {
    execute: async (_run: ClaimedRun, cancel: AbortSignal): Promise<AttemptReport> => {
      if (!cancel.aborted) calls.push(Date.now());
      return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: null };
    },
  } as unknown as HttpExecutor;
  return {
    pool: db.pool,
    nodeId: NODE,
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock: new DbClock(),
    start: (run) => starts.add({ id: run.id, attempt: run.attempt }),
    complete: (run, report) => completeSucceeded(db.pool, run, NODE, report),
    logger: silentLogger,
    metrics,
  };
}

test('a worker whose clock estimate ran 400 ms early calls the run when it is due, not 400 ms early', async () => {
  const run = await claimedAhead(1000);
  const metrics = createMetrics('test');
  const calls: number[] = [];
  const ctx = context(calls, metrics);
  await ctx.clock.sync(db.pool);
  // The run queue would begin the attempt here, believing the run due.
  await untilDbTime(db.pool, run.notBefore.getTime() - 400);
  await runAttempt(ctx, run, new AbortController().signal);
  // PostgreSQL runs on this host: its clock is the one Date.now() reads.
  assert.equal(calls.length, 1);
  assert.ok(
    calls[0]! >= run.notBefore.getTime() - TOLERANCE_MS,
    `called ${run.notBefore.getTime() - calls[0]!} ms before the run was due`,
  );
  assert.ok(
    calls[0]! - run.notBefore.getTime() < 300,
    `called ${calls[0]! - run.notBefore.getTime()} ms late`,
  );
  assert.equal((await metrics.startsEarly.get()).values[0]?.value, 1);
  const { rows } = await db.pool.query<{ state: string }>('SELECT state FROM runs WHERE id = $1', [run.id]);
  assert.equal(rows[0]!.state, 'succeeded');
});

test('a worker stopping while its early estimate waits for the database clock hands the run back uncalled, unstarted', async () => {
  const run = await claimedAhead(1500);
  const calls: number[] = [];
  const ctx = context(calls);
  const cancel = new AbortController();
  const attempt = runAttempt(ctx, run, cancel.signal);
  setTimeout(() => cancel.abort(new WorkerStoppingError('stopping')), 300);
  await attempt;
  assert.deepEqual(calls, []);
  assert.ok((await dbNow(db.pool)) < run.notBefore.getTime(), 'ended before the run was due');
  const { rows } = await db.pool.query<{ state: string; startedAt: Date | null; claimedBy: string | null }>(
    'SELECT state, started_at AS "startedAt", claimed_by AS "claimedBy" FROM runs WHERE id = $1',
    [run.id],
  );
  assert.deepEqual(rows[0], { state: 'queued', startedAt: null, claimedBy: null });
});
