import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { pino } from 'pino';
import {
  createCompletionBatcher,
  createFailureBatcher,
  createReleaseBatcher,
} from '../../src/execution/batching.js';
import { runAttempt } from '../../src/execution/attempt.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { FORGIVEN_EXPIRIES } from '../../src/execution/reaper.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { selectExpiredRuns, type AttemptReport } from '../../src/store/attempts.js';
import { createPool, inTransaction } from '../../src/store/db.js';
import { PoolShare, type Connections } from '../../src/store/pool-share.js';
import { forgiveExpiredClaims } from '../../src/store/releases.js';
import { claimRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { dbNow, untilDbTime, within } from '../support/db-time.js';
import { FaultProxy } from '../support/fault-proxy.js';

// A settle write (a completion, a failure's retry or dead letter, a hand-back) sent on a pooled
// connection gone silent (a NAT or firewall that lost its state: bytes dropped both ways, the
// connection never closed, new connections fine) waited the pool's read timeout (35 s), past the
// claim: the reaper then re-queued a run whose call had succeeded (called again), and the
// batcher's two batches in flight held every settle write of the worker behind it. Each settle
// statement now waits only part of what is left of its claims, and is tried again on another
// connection while the claim holds; its COMMIT waits as the pool says.

const NODE = 'settle-silent';
const TOPICS = { runsTopic: 'helios.runs', deadLetterTopic: 'helios.dead' };
const SUCCESS: AttemptReport = {
  outcome: 'succeeded',
  statusCode: 200,
  durationMs: 5,
  error: null,
  responseExcerpt: null,
};
const FAILURE: AttemptReport = {
  outcome: 'failed',
  statusCode: 503,
  durationMs: 5,
  error: 'HTTP 503',
  responseExcerpt: null,
};

let db: TestDatabase;
let proxy: FaultProxy;
before(async () => {
  db = await createTestDatabase();
  [proxy] = (await FaultProxy.inFrontOf(db.url, 1)) as [FaultProxy];
});
after(async () => {
  await proxy.close();
  await db.drop();
});

/** A run due now, claimed by NODE: its claim lasts its timeout (1 s) + grace. */
async function claimed(maxAttempts = 3, graceMs = 1000): Promise<ClaimedRun> {
  const { rows } = await db.pool.query<{ id: string }>(
    `WITH job AS (
       INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, next_run_at)
       VALUES ('settle-silent-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, $1,
               now() + interval '1 hour') RETURNING id, target, timeout_ms)
     INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT job.id, t, 'queued', $1, job.target, job.timeout_ms, 100, 2, 'allow', t
     FROM job, (SELECT clock_timestamp() AS t) s
     RETURNING runs.id`,
    [maxAttempts],
  );
  const [run] = await claimRuns(db.pool, [{ runId: rows[0]!.id, expectedAttempt: null }], {
    nodeId: NODE,
    graceMs,
    skewToleranceMs: 10,
  });
  assert.ok(run && !run.startPending, 'claimed, due');
  return run;
}

/**
 * The worker's pool (the pool's own read timeout, 35 s) with `idle` idle connections that have
 * gone silent, and a clock estimate; `work` runs with them.
 */
async function onSilentConnections(
  idle: number,
  work: (pool: ReturnType<typeof createPool>, clock: DbClock) => Promise<void>,
): Promise<void> {
  const pool = createPool({
    connectionString: proxy.urlFor(db.url),
    max: 4,
    logger: pino({ level: 'silent' }),
    applicationName: NODE,
  });
  try {
    await Promise.all(Array.from({ length: idle }, () => pool.query('SELECT pg_sleep(0.05)')));
    assert.equal(pool.idleCount, idle);
    const clock = new DbClock();
    await clock.sync(db.pool);
    proxy.silenceExisting();
    await work(pool, clock);
  } finally {
    // Closed: a statement still waiting on a silent connection (before the fix) ends now.
    proxy.heal({ closeExisting: true });
    await pool.end();
  }
}

/** Fails unless `write` answered before the claims of `runs` expired (by the database clock). */
async function beforeTheClaims<T>(runs: ClaimedRun[], write: Promise<T>, what: string): Promise<T> {
  const expires = Math.min(...runs.map((run) => run.claimExpiresAt.getTime()));
  const { value } = await within(write, Math.max(0, expires - (await dbNow(db.pool))), what);
  assert.ok((await dbNow(db.pool)) < expires, `${what}: answered before the claim expired`);
  return value;
}

async function settled(runId: string) {
  const { rows } = await db.pool.query<{
    state: string;
    outcomes: string[];
    announced: number;
    letters: number;
  }>(
    `SELECT r.state,
            (SELECT array_agg(outcome ORDER BY attempt) FROM run_attempts WHERE run_id = r.id) AS outcomes,
            (SELECT count(*)::int FROM outbox WHERE payload->>'runId' = r.id::text) AS announced,
            (SELECT count(*)::int FROM dead_letters WHERE run_id = r.id) AS letters
     FROM runs r WHERE r.id = $1`,
    [runId],
  );
  return rows[0];
}

test('a completion on a connection gone silent is written on another before the claim expires', async () => {
  const run = await claimed();
  await onSilentConnections(1, async (pool, clock) => {
    const completions = createCompletionBatcher(pool, NODE, undefined, clock);
    const done = await beforeTheClaims(
      [run],
      completions.add({ run, report: SUCCESS }),
      'the completion on a silent connection',
    );
    assert.equal(done, true, 'completed, on another connection');
  });
  assert.deepEqual(await settled(run.id), {
    state: 'succeeded',
    outcomes: ['succeeded'],
    announced: 0,
    letters: 0,
  });
});

test("a completion through the worker's share on a connection gone silent, new connections slow to open: written on another before the claim expires", async () => {
  // The statement given up on is cancelled in PostgreSQL (db.ts cancelStatement) on a connection
  // of its own, which a database slow to take new sessions answers late: the caller waited for it
  // (1 s at most) before its retry, which then opened its own connection, as slowly: the retry
  // was answered after the claim had expired, and the reaper would re-queue a run whose call had
  // succeeded.
  const run = await claimed(3, 2000);
  await onSilentConnections(1, async (pool, clock) => {
    proxy.newConnectionDelayMs = 1000;
    try {
      const completions = createCompletionBatcher(new PoolShare(pool, 2), NODE, undefined, clock);
      const done = await beforeTheClaims(
        [run],
        completions.add({ run, report: SUCCESS }),
        'the completion on a silent connection, new connections slow',
      );
      assert.equal(done, true, 'completed, on another connection');
    } finally {
      proxy.newConnectionDelayMs = 0;
    }
  });
  assert.equal((await settled(run.id))?.state, 'succeeded');
});

test('a batch of completions on a connection gone silent, one of its claims short and another long, is answered before the short one expires', async () => {
  // The batch's statement waited half of the latest claim (the long one's: 30 s), past the
  // short claim: the reaper would re-queue a run whose call had succeeded.
  const short = await claimed(3, 2000);
  const long = await claimed(3, 60_000);
  await onSilentConnections(1, async (pool, clock) => {
    const completions = createCompletionBatcher(pool, NODE, undefined, clock);
    const done = await beforeTheClaims(
      [short],
      Promise.all([short, long].map((run) => completions.add({ run, report: SUCCESS }))),
      'the batch of a short claim and a long one on a silent connection',
    );
    assert.deepEqual(done, [true, true], 'completed, on another connection');
  });
  for (const run of [short, long]) assert.equal((await settled(run.id))?.state, 'succeeded');
});

/**
 * `run`'s attempt whose call succeeds, its completion written through a completion batcher on
 * `pool` with `clock`; `calls` records each call made.
 */
function succeedingAttempt(
  run: ClaimedRun,
  pool: Connections,
  clock: DbClock,
  calls: string[],
): Promise<void> {
  const executor = {
    execute: async (called: ClaimedRun): Promise<AttemptReport> => {
      calls.push(`${called.id}/${called.attempt}`);
      return SUCCESS;
    },
  } as unknown as HttpExecutor;
  const completions = createCompletionBatcher(pool, NODE, undefined, clock);
  return runAttempt(
    {
      pool,
      nodeId: NODE,
      executor,
      topics: TOPICS,
      clock,
      start: async () => true,
      complete: (claimed, report) => completions.add({ run: claimed, report }),
      logger: silentLogger,
      metrics: createMetrics('test'),
    },
    run,
    new AbortController().signal,
  );
}

/** The reaper's pass over `runId` alone: the runs it re-queued (a claim still there, expired). */
function reaperPass(runId: string) {
  return inTransaction(db.pool, async (client) => {
    const expired = (await selectExpiredRuns(client, 100)).filter((e) => e.id === runId);
    return forgiveExpiredClaims(
      client,
      expired.map((e) => ({ run: e, error: 'claim expired' })),
      FORGIVEN_EXPIRIES,
      'runs',
    );
  });
}

test('a call that succeeded, its completion sent on a connection gone silent: the reaper finds nothing to take back once the claim ends, and the run is not called again', async () => {
  const run = await claimed();
  const calls: string[] = [];
  await onSilentConnections(1, async (pool, clock) => {
    const attempt = succeedingAttempt(run, pool, clock, calls);
    // The reaper, once the claim has expired: it re-queues a run whose claim is still there.
    await untilDbTime(db.pool, run.claimExpiresAt.getTime() + 50);
    const taken = await reaperPass(run.id);
    assert.deepEqual(taken, [], 'the reaper took the claim back: the run would be called again');
    await within(attempt, 1000, 'the attempt');
  });
  assert.deepEqual(calls, [`${run.id}/1`]);
  assert.deepEqual(await settled(run.id), {
    state: 'succeeded',
    outcomes: ['succeeded'],
    announced: 0,
    letters: 0,
  });
});

test("a call that succeeded, its run's row locked until just past the claim: the completion lands when the lock goes, before the reaper", async () => {
  // An operator's or a migration's transaction holds the run's row past its claim. The
  // completion's statement, given up on client-side at its bound, used to go on waiting for the
  // lock in PostgreSQL and committed the moment it was let go: the reaper found nothing to take
  // back. Cancelled in PostgreSQL (db.ts cancelStatement), every try is gone by the time the
  // lock is, the worker stops trying once the claim has expired, and the reaper re-queues a run
  // whose call succeeded: it is called again.
  const run = await claimed();
  const pool = createPool({
    connectionString: db.url,
    max: 4,
    logger: pino({ level: 'silent' }),
    applicationName: NODE,
  });
  const share = new PoolShare(pool, 3);
  const blocker = await db.pool.connect();
  const calls: string[] = [];
  try {
    const clock = new DbClock();
    await clock.sync(db.pool);
    await blocker.query('BEGIN');
    await blocker.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE', [run.id]);
    const attempt = succeedingAttempt(run, share, clock, calls);
    await untilDbTime(db.pool, run.claimExpiresAt.getTime() + 100);
    await blocker.query('COMMIT');
    await within(attempt, 3000, 'the attempt');
    await sleep(200);
    // The reaper's pass after the lock: it re-queues a run whose claim is still there.
    const taken = await reaperPass(run.id);
    assert.deepEqual(taken, [], 'the reaper took the claim back: the run would be called again');
  } finally {
    await blocker.query('ROLLBACK').catch(() => undefined);
    blocker.release();
    await pool.end();
  }
  assert.deepEqual(calls, [`${run.id}/1`]);
  assert.equal((await settled(run.id))?.state, 'succeeded');
});

test("failures on connections gone silent (the retries' statement, the burials' transaction) are settled on others before the claims expire, once each", async () => {
  const retried = await claimed(3);
  const buried = await claimed(1);
  await onSilentConnections(2, async (pool, clock) => {
    const failures = createFailureBatcher(pool, NODE, TOPICS, clock);
    const results = await beforeTheClaims(
      [retried, buried],
      Promise.all(
        [retried, buried].map((run) => failures.add({ run, report: FAILURE, retryDelayMs: 60_000 })),
      ),
      'the failures on silent connections',
    );
    assert.deepEqual(
      results.map((result) => result?.state),
      ['queued', 'dead'],
    );
  });
  assert.deepEqual(await settled(retried.id), {
    state: 'queued',
    outcomes: ['failed'],
    announced: 1,
    letters: 0,
  });
  assert.deepEqual(await settled(buried.id), {
    state: 'dead',
    outcomes: ['failed'],
    announced: 1,
    letters: 1,
  });
});

test('a burial whose connection went silent before its COMMIT is settled on another before the claim expires, once', async () => {
  // The transaction's COMMIT waited the pool's 35 s, past the claim; PostgreSQL, which never got
  // it, ended the transaction (idle_in_transaction_session_timeout, 5 s) and the run's row with it.
  const run = await claimed(1, 7000);
  const pool = createPool({
    connectionString: proxy.urlFor(db.url),
    max: 4,
    logger: pino({ level: 'silent' }),
    applicationName: NODE,
  });
  let silenced = false;
  const silencedAtCommit: Connections = {
    query: pool.query.bind(pool),
    connect: (async () => {
      const client = await pool.connect();
      const query = client.query.bind(client);
      client.query = ((config: unknown, ...rest: unknown[]) => {
        if (!silenced && (config as { text?: string } | null)?.text === 'COMMIT') {
          silenced = true;
          proxy.silenceExisting();
        }
        return (query as (...args: unknown[]) => unknown)(config, ...rest);
      }) as typeof client.query;
      return client;
    }) as Connections['connect'],
  };
  try {
    const clock = new DbClock();
    await clock.sync(db.pool);
    const failures = createFailureBatcher(silencedAtCommit, NODE, TOPICS, clock);
    const result = await beforeTheClaims(
      [run],
      failures.add({ run, report: FAILURE, retryDelayMs: 60_000 }),
      'the burial whose COMMIT went to a silent connection',
    );
    assert.ok(silenced, 'the COMMIT was sent on a connection gone silent');
    assert.equal(result?.state, 'dead');
  } finally {
    proxy.heal({ closeExisting: true });
    await pool.end();
  }
  assert.deepEqual(await settled(run.id), { state: 'dead', outcomes: ['failed'], announced: 1, letters: 1 });
});

test('a hand-back on a connection gone silent is written on another before the claim expires', async () => {
  const run = await claimed();
  await onSilentConnections(1, async (pool, clock) => {
    const releases = createReleaseBatcher(pool, NODE, TOPICS.runsTopic, clock);
    const report: AttemptReport = { ...FAILURE, outcome: 'cancelled', statusCode: null, error: 'stopping' };
    const message = await beforeTheClaims(
      [run],
      releases.add({ run, report }),
      'the hand-back on a silent connection',
    );
    assert.equal(message?.attempt, 2, "the next attempt's announcement");
  });
  assert.deepEqual(await settled(run.id), {
    state: 'queued',
    outcomes: ['cancelled'],
    announced: 1,
    letters: 0,
  });
});

test('a hand-back given up on while PostgreSQL still ran it commits once: its retry finds the claim settled, one announcement', async () => {
  // The run's row locked meanwhile: the batch's statement waits on the server past its bound (half
  // the 4 s claim), is given up on, and its retry on another connection waits behind it; both go
  // on once the lock is gone, the first commits, and the retry finds nothing left to hand back.
  const run = await claimed(3, 3000);
  const blocker = await db.pool.connect();
  const pool = createPool({
    connectionString: db.url,
    max: 4,
    logger: pino({ level: 'silent' }),
    applicationName: NODE,
  });
  try {
    await blocker.query('BEGIN');
    await blocker.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE', [run.id]);
    const clock = new DbClock();
    await clock.sync(db.pool);
    const releases = createReleaseBatcher(pool, NODE, TOPICS.runsTopic, clock);
    const report: AttemptReport = { ...FAILURE, outcome: 'cancelled', statusCode: null, error: 'stopping' };
    const answer = releases.add({ run, report });
    for (let waiting = 0; waiting < 2; await sleep(50)) {
      const { rows } = await db.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`,
        [NODE],
      );
      waiting = rows[0]!.n;
      assert.ok((await dbNow(db.pool)) < run.claimExpiresAt.getTime() - 500, 'the batch was given up on');
    }
    await blocker.query('COMMIT');
    assert.equal(await answer, null, 'the retry found the claim handed back already');
  } finally {
    await blocker.query('ROLLBACK').catch(() => undefined);
    blocker.release();
    await pool.end();
  }
  const { rows } = await db.pool.query<{ maxAttempts: number }>(
    'SELECT max_attempts AS "maxAttempts" FROM runs WHERE id = $1',
    [run.id],
  );
  assert.deepEqual(rows, [{ maxAttempts: 4 }], 'handed back once (no attempt used up)');
  assert.deepEqual(await settled(run.id), {
    state: 'queued',
    outcomes: ['cancelled'],
    announced: 1,
    letters: 0,
  });
});
