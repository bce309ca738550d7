import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import pg from 'pg';
import { setTimeout as sleep } from 'node:timers/promises';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { FORGIVEN_EXPIRIES } from '../../src/execution/reaper.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, type AttemptReport } from '../../src/store/attempts.js';
import type { Queryable } from '../../src/store/db.js';
import { claimRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilDbTime } from '../support/db-time.js';
import { jobWithQueuedRuns } from '../support/execution.js';

// A claim whose call could not end before it expires is handed back uncalled (attempt.ts
// whyNotStart, claim-too-late): re-queued and announced without using up an attempt. When the
// cause lasts (runs that wait for a slot past a small HELIOS_CLAIM_GRACE_MS under steady load, a
// worker whose estimate of the database clock runs ahead by more than the grace), the same run was
// claimed and handed back for ever: never called, never dead, max_attempts growing by one a claim.

let db: TestDatabase;
const A = 'node-a';
const GRACE_MS = 200;

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** A worker on node A (`clock`: its estimate of the database clock) whose calls go to `calls`. */
function worker(calls: string[], clock = new DbClock()): AttemptContext {
  const executor = {
    execute: async (run: ClaimedRun): Promise<AttemptReport> => {
      calls.push(`${A}:${run.attempt}`);
      return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: null };
    },
  } as unknown as HttpExecutor;
  return {
    pool: db.pool,
    nodeId: A,
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock,
    start: async () => true,
    complete: (run, report) => completeSucceeded(db.pool, run, A, report),
    logger: silentLogger,
    metrics: createMetrics('test'),
  };
}

/** An `allow` job's run, due a second ago (1 s timeout, 3 attempts). */
async function dueRun(name: string): Promise<string> {
  const { runs } = await jobWithQueuedRuns(db.pool, {
    name,
    schedule: '* * * * * *',
    concurrency: 'allow',
    dueAt: ["clock_timestamp() - interval '1 second'"],
  });
  return runs[0]!;
}

const claim = async (id: string) =>
  (
    await claimRuns(db.pool, [{ runId: id, expectedAttempt: null }], {
      nodeId: A,
      graceMs: GRACE_MS,
      skewToleranceMs: 10,
    })
  )[0] ?? null;

async function stateOf(id: string) {
  const { rows } = await db.pool.query(
    `SELECT state, attempt, max_attempts, expiries,
            (SELECT count(*)::int FROM dead_letters d WHERE d.run_id = r.id) AS letters
     FROM runs r WHERE id = $1`,
    [id],
  );
  return rows[0];
}

const outcomes = async (ctx: AttemptContext) =>
  (await ctx.metrics.runsExecuted.get()).values.map((v) => `${v.labels.outcome}=${v.value}`);

test('a run whose every claim is acknowledged too late ends dead after its forgiven hand-backs and its attempts, uncalled', async () => {
  const id = await dueRun('late');
  const calls: string[] = [];
  const a = worker(calls);
  await a.clock.sync(db.pool);
  let claims = 0;
  // Each claim waits for a slot past its grace (a node that starts fewer runs than it claims ahead),
  // then reaches its call with less than the timeout left. Bounded here in case it loops.
  for (; claims < 8; claims++) {
    const run = await claim(id);
    if (!run) break;
    await untilDbTime(db.pool, run.claimExpiresAt.getTime() - run.timeoutMs);
    await runAttempt(a, run, new AbortController().signal);
  }
  assert.deepEqual(calls, []);
  // Forgiven twice (max_attempts 3 + 2), then charged for its 3 attempts.
  assert.deepEqual(await stateOf(id), {
    state: 'dead',
    attempt: 5,
    max_attempts: 5,
    expiries: 2,
    letters: 1,
  });
  assert.equal(claims, FORGIVEN_EXPIRIES + 3);
  assert.deepEqual(await outcomes(a), ['claim-too-late=5']);
});

test('a worker whose estimate of the database clock runs ahead by more than the grace re-samples it after a claim handed back too late: its next claim is called', async () => {
  const id = await dueRun('ahead');
  // A sample whose round trip was lengthened before the database read its clock (2 s here): its
  // midpoint puts the estimate ≈1 s ahead, more than the grace.
  const delayed = {
    query: async (text: string) => {
      await sleep(2000);
      return db.pool.query(text);
    },
  } as unknown as Queryable;
  const clock = new DbClock();
  await clock.sync(delayed, 0, 1);
  assert.ok(clock.offset > 5 * GRACE_MS, `estimate ahead by ${Math.round(clock.offset)} ms`);
  // Re-sampled at most once a second on a hand-back (attempt.ts); the periodic sync comes at 30 s.
  await sleep(1000);
  const calls: string[] = [];
  const a = worker(calls, clock);
  for (let claims = 0; claims < 3 && calls.length === 0; claims++) {
    const run = await claim(id);
    assert.ok(run, 'claimed');
    await runAttempt(a, run, new AbortController().signal);
  }
  assert.deepEqual(calls, [`${A}:2`], 'called by the claim after the first one handed back');
  assert.deepEqual(await outcomes(a), ['claim-too-late=1', 'succeeded=1']);
  assert.equal((await stateOf(id))!.state, 'succeeded');
});

test('a worker whose pool is saturated samples the database clock without the wait for a connection', async () => {
  // One connection, kept busy: three loops of 150 ms statements, so a query waits 300 ms for it.
  const pool = new pg.Pool({ connectionString: db.url, max: 1 });
  pool.on('error', () => undefined);
  let busy = true;
  const loops = [0, 1, 2].map(async () => {
    while (busy) await pool.query('SELECT pg_sleep(0.15)');
  });
  try {
    await sleep(50);
    const reference = new DbClock();
    await reference.sync(db.pool);
    const clock = new DbClock();
    await clock.sync(pool);
    // Through the pool, each sample's round trip included ≈300 ms of waiting for the connection,
    // before the clock was read: the estimate ran ≈150 ms ahead.
    const aheadMs = clock.offset - reference.offset;
    assert.ok(Math.abs(aheadMs) < 40, `estimate ${Math.round(aheadMs)} ms off`);
  } finally {
    busy = false;
    await Promise.all(loops);
    await pool.end();
  }
});
