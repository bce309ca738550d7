import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type pg from 'pg';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { createStartBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { deleteJob, pauseJob } from '../../src/jobs/commands.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, selectExpiredRuns, type AttemptReport } from '../../src/store/attempts.js';
import { forgiveExpiredClaims } from '../../src/store/releases.js';
import { inTransaction } from '../../src/store/db.js';
import type { Connections } from '../../src/store/pool-share.js';
import { claimRuns, type ClaimedRun, type ClaimOptions } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilDbTime } from '../support/db-time.js';

// START through the real start batcher (createStartBatcher: a failed
// batch falls back to oneByOne, one statement per run) and the real runAttempt retry loop
// (startWhenDue), with a pool that loses the first START's answer (after or before it commits)
// while a pause, or the reaper plus another node's re-claim, lands in between. Each case checks that
// what the worker does (call or not) matches what the database says the pause / reaper saw, and
// that the occurrence is called at most once.

let db: TestDatabase;
const A = 'node-a';
const B = 'node-b';
const COMMANDS = { runsTopic: 'runs', misfireThresholdMs: 5000 };

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

async function setup(timeoutMs = 1000) {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     VALUES ('la-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', $1, 3, 'allow',
             now() + interval '1 hour') RETURNING id`,
    [timeoutMs],
  );
  const jobId = rows[0]!.id;
  const { rows: runs } = await db.pool.query<{ id: string; scheduledFor: Date }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, t, 'queued', 3, j.target, j.timeout_ms, 100, 2, 'allow', t
     FROM jobs j, (SELECT date_trunc('second', clock_timestamp()) + interval '2 seconds' AS t) s
     WHERE j.id = $1 RETURNING id, scheduled_for AS "scheduledFor"`,
    [jobId],
  );
  return { jobId, run: runs[0]! };
}

const claimAhead = async (
  id: string,
  nodeId: string,
  extra: Partial<ClaimOptions> = {},
  expected: number | null = null,
) => {
  const [run] = await claimRuns(db.pool, [{ runId: id, expectedAttempt: expected }], {
    nodeId,
    graceMs: 5000,
    skewToleranceMs: 10,
    leadMs: 600_000,
    ...extra,
  });
  assert.ok(run, `claimed by ${nodeId}`);
  return run;
};

/**
 * The pool as the worker's start batcher uses it, losing the first START statement's answer:
 * `commit` decides whether that statement reaches the database first; `between` runs before the
 * error is thrown (the racing pause / reaper). Every later statement goes through.
 */
function lossyPool(commit: boolean, between: () => Promise<void>): Connections & { starts: number } {
  const wrapper = {
    starts: 0,
    connect: () => db.pool.connect(),
    query: (async (config: pg.QueryConfig, values?: unknown[]) => {
      const isStart = typeof config === 'object' && config?.name === 'helios-start-runs';
      if (isStart) wrapper.starts += 1;
      if (isStart && wrapper.starts === 1) {
        if (commit) await db.pool.query(config, values);
        await between();
        throw new Error('Connection terminated unexpectedly');
      }
      return db.pool.query(config, values);
    }) as unknown as pg.Pool['query'],
  };
  return wrapper;
}

function context(pool: Connections, nodeId: string, calls: string[]): AttemptContext {
  const starts = createStartBatcher(pool, nodeId, 10);
  const executor = {
    execute: async (run: ClaimedRun, cancel: AbortSignal): Promise<AttemptReport> => {
      if (!cancel.aborted) calls.push(`${nodeId}:${run.id}:${run.attempt}`);
      return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: null };
    },
  } as unknown as HttpExecutor;
  return {
    pool: db.pool,
    nodeId,
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock: new DbClock(),
    start: (run) => starts.add({ id: run.id, attempt: run.attempt }),
    complete: (run, report) => completeSucceeded(db.pool, run, nodeId, report),
    logger: silentLogger,
    metrics: createMetrics('test'),
  };
}

async function row(id: string) {
  const { rows } = await db.pool.query<{ state: string; startedAt: Date | null; attempt: number }>(
    `SELECT state, started_at AS "startedAt", attempt FROM runs WHERE id = $1`,
    [id],
  );
  return rows[0] ?? null;
}

for (const commit of [true, false]) {
  for (const racer of ['pause', 'delete'] as const) {
    test(`(a) START ${commit ? 'committed, answer lost' : 'lost before reaching the database'}, a ${racer} in between: call made iff the run survived it, once`, async () => {
      const { jobId, run } = await setup();
      const claimed = await claimAhead(run.id, A);
      assert.equal(claimed.startPending, true);
      const calls: string[] = [];
      let seenAfter: Awaited<ReturnType<typeof row>> | undefined;
      const pool = lossyPool(commit, async () => {
        if (racer === 'pause')
          assert.equal((await pauseJob(db.pool, { id: jobId }, COMMANDS))?.enabled, false);
        else assert.equal(await deleteJob(db.pool, { id: jobId }), true);
        seenAfter = await row(run.id);
      });
      const ctx = context(pool, A, calls);
      await ctx.clock.sync(db.pool);
      await untilDbTime(db.pool, run.scheduledFor);
      // START is sent at the run's time, so the pause's line is after the occurrence: the run is
      // owed (kept, started or not); a deletion takes it whatever its state.
      await runAttempt(ctx, claimed, new AbortController().signal);
      assert.ok(pool.starts >= 2, 'the START was tried again (oneByOne fallback)');
      const kept = seenAfter !== null && seenAfter !== undefined;
      assert.equal(kept, racer === 'pause');
      if (kept && commit) assert.ok(seenAfter!.startedAt, 'the pause saw it started');
      assert.deepEqual(calls, kept ? [`${A}:${run.id}:1`] : [], 'call made iff the run survived, once');
      if (kept) assert.equal((await row(run.id))?.state, 'succeeded');
    });
  }
}

for (const commit of [true, false]) {
  test(`(b) START batch fails (${commit ? 'after' : 'before'} commit); meanwhile the claim expires, the reaper forgives it and node B re-claims attempt 2: A's one-by-one START loses, the occurrence is called once`, async () => {
    const { run } = await setup(100);
    const claimedA = await claimAhead(run.id, A, { graceMs: 100 });
    assert.equal(claimedA.startPending, true);
    const calls: string[] = [];
    let claimedB: ClaimedRun | undefined;
    const pool = lossyPool(commit, async () => {
      await untilDbTime(db.pool, new Date(claimedA.claimExpiresAt.getTime() + 20));
      const forgiven = await inTransaction(db.pool, async (c) => {
        let n = 0;
        for (const r of await selectExpiredRuns(c, 100)) {
          const report = {
            outcome: 'expired' as const,
            statusCode: null,
            durationMs: null,
            error: 'expired',
            responseExcerpt: null,
          };
          if ((await forgiveExpiredClaims(c, [{ run: r, error: report.error }], 2, 'runs'))[0]) n += 1;
        }
        return n;
      });
      assert.equal(forgiven, 1);
      claimedB = await claimAhead(run.id, B, {}, 2);
    });
    const ctxA = context(pool, A, calls);
    await ctxA.clock.sync(db.pool);
    await untilDbTime(db.pool, run.scheduledFor);
    // A's claim deadline is only ~200 ms after its time: give runAttempt a claim that still looks
    // long enough locally (a worker whose clock estimate lags), so whyNotStart cannot hide a START
    // that wrongly succeeds.
    await runAttempt(
      ctxA,
      { ...claimedA, claimExpiresAt: new Date(Date.now() + 60_000) },
      new AbortController().signal,
    );
    assert.ok(claimedB);
    assert.equal(claimedB.attempt, 2);
    // The forgiven run is due at once (not_before = now()): B's claim starts it.
    assert.equal(claimedB.startPending, false);
    const ctxB = context(db.pool, B, calls);
    await ctxB.clock.sync(db.pool);
    await runAttempt(ctxB, claimedB, new AbortController().signal);
    assert.deepEqual(calls, [`${B}:${run.id}:2`], 'only node B, at attempt 2, calls the occurrence');
  });
}
