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
// whyNotStart, claim-too-late): re-queued and announced without using up an attempt, however many
// times: a database coming back from an outage answers claims late for seconds, and counted with
// the forgiven expiries such hand-backs buried runs due meanwhile (leader-stall-review-blackhole).
// A worker whose estimate of the database clock ran ahead by more than the grace handed back every
// claim until its next sync (30 s): the hand-back now re-samples it, and a pool's wait for a
// connection no longer skews a sample.

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

test('claims acknowledged too late are handed back uncharged, however many: the run keeps its attempts and is called once a claim is in time', async () => {
  const id = await dueRun('late');
  const calls: string[] = [];
  const a = worker(calls);
  await a.clock.sync(db.pool);
  // Each claim waits past its grace (a slot, a database answering late), then reaches its call
  // with less than the timeout left: handed back. More times than the forgiven expiries.
  const late = FORGIVEN_EXPIRIES + 3;
  for (let claims = 0; claims < late; claims++) {
    const run = await claim(id);
    assert.ok(run, `claim ${claims + 1}`);
    await untilDbTime(db.pool, run.claimExpiresAt.getTime() - run.timeoutMs);
    await runAttempt(a, run, new AbortController().signal);
  }
  assert.deepEqual(calls, []);
  assert.deepEqual(await stateOf(id), {
    state: 'queued',
    attempt: late,
    max_attempts: 3 + late,
    expiries: 0,
    letters: 0,
  });
  // A claim in time is called.
  const run = await claim(id);
  assert.ok(run);
  await runAttempt(a, run, new AbortController().signal);
  assert.deepEqual(calls, [`${A}:${late + 1}`]);
  assert.deepEqual(await outcomes(a), [`claim-too-late=${late}`, 'succeeded=1']);
});

test('a worker whose estimate of the database clock runs ahead by more than the grace re-samples it after a claim handed back too late: its next claim is called', async () => {
  const id = await dueRun('ahead');
  // A sample whose round trip was lengthened before the database read its clock (2.5 s here): its
  // midpoint puts the estimate ≈1.25 s ahead, more than the grace (≈1 s at 2 s came out 998 ms once).
  const delayed = {
    query: async (text: string) => {
      await sleep(2500);
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
