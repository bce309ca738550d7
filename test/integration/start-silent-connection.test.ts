import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { pino } from 'pino';
import { createStartBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import { createPool } from '../../src/store/db.js';
import { claimRuns, startRuns, type ClaimedRun } from '../../src/store/runs.js';
import type pg from 'pg';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, type AttemptReport } from '../../src/store/attempts.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilDbTime, within } from '../support/db-time.js';
import { FaultProxy } from '../support/fault-proxy.js';

// A START sent on a pooled connection gone silent (a NAT or firewall that lost its state: bytes
// dropped both ways, the connection never closed, new connections fine) waited the pool's read
// timeout (35 s), and the start batcher's two batches in flight held every START of the worker
// behind it: its runs claimed ahead waited out their claims uncalled. A START now waits only as
// long as a call begun after it could still end within the claim, and is tried again on another
// connection.

const NODE = 'start-silent';
const GRACE_MS = 1000;
const TIMEOUT_MS = 1000;

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

/** A run of a new job due `dueInMs` from now by the database clock, claimed ahead by NODE. */
async function runClaimedAhead(dueInMs: number): Promise<ClaimedRun> {
  const { rows } = await db.pool.query<{ id: string }>(
    `WITH job AS (
       INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, next_run_at)
       VALUES ('silent-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', $1, 3,
               now() + interval '1 hour') RETURNING id, target, timeout_ms)
     INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT job.id, t, 'queued', 3, job.target, job.timeout_ms, 100, 2, 'allow', t
     FROM job, (SELECT clock_timestamp() + $2 * interval '1 millisecond' AS t) s
     RETURNING runs.id`,
    [TIMEOUT_MS, dueInMs],
  );
  const [run] = await claimRuns(db.pool, [{ runId: rows[0]!.id, expectedAttempt: null }], {
    nodeId: NODE,
    graceMs: GRACE_MS,
    skewToleranceMs: 10,
    leadMs: dueInMs + 10_000,
  });
  assert.ok(run?.startPending, 'claimed ahead, to be started');
  return run;
}

test('a START on a connection gone silent gives up when the call could no longer end within the claim, and starts the run on another', async () => {
  const run = await runClaimedAhead(1000);

  // The worker's pool: the pool's own read timeout (35 s), one idle connection that goes silent.
  const pool = createPool({
    connectionString: proxy.urlFor(db.url),
    max: 4,
    logger: pino({ level: 'silent' }),
    applicationName: NODE,
  });
  try {
    await pool.query('SELECT 1');
    assert.equal(pool.idleCount, 1);
    const clock = new DbClock();
    await clock.sync(db.pool);
    const starts = createStartBatcher(pool, NODE, 10, clock);
    proxy.silenceExisting();
    await untilDbTime(db.pool, run.notBefore);

    const answerBy = run.claimExpiresAt.getTime() - run.timeoutMs;
    const { value, ms } = await within(
      starts.add({ id: run.id, attempt: run.attempt, answerBy }),
      5000,
      'the START on a silent connection',
    );
    assert.equal(value, true, 'started, on another connection');
    assert.ok(ms < GRACE_MS + 1000, `answered ${Math.round(ms)} ms after it was asked`);
    const { rows: started } = await db.pool.query<{ started: boolean }>(
      'SELECT started_at IS NOT NULL AS started FROM runs WHERE id = $1',
      [run.id],
    );
    assert.deepEqual(started, [{ started: true }]);
  } finally {
    proxy.heal();
    await pool.end();
  }
});

async function attemptCallsWithinClaim(meanwhile: (runId: string) => Promise<void>) {
  const run = await runClaimedAhead(1000);

  const pool = createPool({
    connectionString: proxy.urlFor(db.url),
    max: 4,
    logger: pino({ level: 'silent' }),
    applicationName: NODE,
  });
  try {
    await pool.query('SELECT 1');
    assert.equal(pool.idleCount, 1);
    const clock = new DbClock();
    await clock.sync(db.pool);
    // As the worker wires it (worker.ts): the START batcher on the worker's pool, each START
    // answered by the instant a call begun after it could still end within the claim.
    const starts = createStartBatcher(pool, NODE, 10, clock);
    const calls: number[] = [];
    const ctx: AttemptContext = {
      pool: db.pool,
      nodeId: NODE,
      executor: {
        execute: async (): Promise<AttemptReport> => {
          calls.push(clock.latestNow());
          return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: null };
        },
      } as unknown as HttpExecutor,
      topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
      clock,
      start: (claimed) =>
        starts.add({
          id: claimed.id,
          attempt: claimed.attempt,
          answerBy: claimed.claimExpiresAt.getTime() - claimed.timeoutMs,
        }),
      complete: (claimed, report) => completeSucceeded(db.pool, claimed, NODE, report),
      logger: silentLogger,
      metrics: createMetrics('test'),
    };
    await untilDbTime(db.pool, run.notBefore);
    await meanwhile(run.id);

    await within(runAttempt(ctx, run, new AbortController().signal), 5000, 'the attempt');
    const { rows: after } = await db.pool.query<{ state: string; attempt: number }>(
      'SELECT state, attempt FROM runs WHERE id = $1',
      [run.id],
    );
    assert.deepEqual(
      { calls: calls.length, ...after[0] },
      { calls: 1, state: 'succeeded', attempt: 1 },
      'called by this worker within its claim (not handed back as claimed too late)',
    );
  } finally {
    proxy.heal();
    await pool.end();
  }
}

test('a START on a connection gone silent is tried again on another in time for the call: the worker calls the run within its claim, not handing it back', () =>
  attemptCallsWithinClaim(async () => {
    proxy.silenceExisting();
  }));

test('a START the database answers slowly (a row lock held past half its bound) still counts: the run is called within its claim', () =>
  attemptCallsWithinClaim(async (runId) => {
    const holder = await db.pool.connect();
    await holder.query('BEGIN');
    await holder.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE', [runId]);
    setTimeout(() => {
      void holder.query('COMMIT').finally(() => holder.release());
    }, GRACE_MS * 0.7);
  }));

test('a START that finds its run not yet due, while another START of it (a resend) starts it, answers started, not withdrawn', async () => {
  const run = await runClaimedAhead(30_000);
  // START misses the run (not due within 10 ms); before its second statement asks why, the other
  // START of the run commits (one asked without the due check: the database clock's own START).
  const pool = {
    connect: () => db.pool.connect(),
    query: (async (config: pg.QueryConfig, values?: unknown[]) => {
      if (typeof config === 'object' && config.name === 'helios-start-not-yet-due')
        assert.deepEqual(await startRuns(db.pool, NODE, [run]), [true], 'the other START started it');
      return db.pool.query(config, values);
    }) as unknown as pg.Pool['query'],
  };
  assert.deepEqual(await startRuns(pool, NODE, [run], 10), [true]);
});
