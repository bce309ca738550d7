import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, beforeEach, test } from 'node:test';
import type pg from 'pg';
import type { Leadership } from '../../src/coordination/election.js';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { createStartBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { Reaper } from '../../src/execution/reaper.js';
import { pauseJob } from '../../src/jobs/commands.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import {
  completeSucceeded,
  failAttempt,
  releaseClaim,
  selectExpiredRuns,
  type AttemptReport,
} from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';
import { forgiveExpiredClaims } from '../../src/store/releases.js';
import { createManualRun } from '../../src/store/manual-run.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import type { Connections } from '../../src/store/pool-share.js';
import { claimRuns, startRuns, type ClaimedRun, type ClaimOptions } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { dbNow, untilDbTime } from '../support/db-time.js';

// Review of the reaper's take-back of runs claimed ahead whose call has not begun (store/attempts.ts,
// claimOver; commit 8f6745e). The reaper here uses a short `unstartedAfterMs` (UNSTARTED_MS) while
// the workers' claims carry a long grace (5 s): a worker whose clock estimate lags, or whose
// HELIOS_CLAIM_GRACE_MS is larger than the leader's, may still call after the reaper's line, so
// whyNotStart cannot hide a wrong take-back; only the database (START against the reaper's
// forgiveness, on the same row) keeps a run from being called twice.

let db: TestDatabase;
const A = 'node-a';
const B = 'node-b';
const UNSTARTED_MS = 300;
const topics = { runsTopic: 'runs', deadLetterTopic: 'dead' };
const COMMANDS = { runsTopic: 'runs', misfireThresholdMs: 5000 };

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());
beforeEach(() => db.pool.query('DELETE FROM jobs'));

const leadership = (signal = new AbortController().signal): Leadership => ({
  nodeId: 'leader',
  token: 1n,
  since: new Date(),
  signal,
  isValid: () => !signal.aborted,
});

const reaper = (pool: pg.Pool = db.pool, signal?: AbortSignal) =>
  new Reaper({
    pool,
    leadership: leadership(signal),
    topics,
    intervalMs: 1000,
    unstartedAfterMs: UNSTARTED_MS,
    logger: silentLogger,
    metrics: createMetrics('test'),
    onFenced: () => assert.fail('fenced'),
  });

/** A job and one queued scheduled run of it due `dueInMs` from now. */
async function setup(
  options: { dueInMs?: number; concurrency?: string; timeoutMs?: number; maxAttempts?: number } = {},
) {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, concurrency, next_run_at)
     VALUES ('rv-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', $1, $2, 0, $3,
             now() + interval '1 hour') RETURNING id`,
    [options.timeoutMs ?? 1000, options.maxAttempts ?? 1, options.concurrency ?? 'allow'],
  );
  const jobId = rows[0]!.id;
  const { rows: runs } = await db.pool.query<{ id: string; scheduledFor: Date }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, t, 'queued', j.max_attempts, j.target, j.timeout_ms, 0, 2, j.concurrency, t
     FROM jobs j, (SELECT clock_timestamp() + $2 * interval '1 millisecond' AS t) s
     WHERE j.id = $1 RETURNING id, scheduled_for AS "scheduledFor"`,
    [jobId, options.dueInMs ?? 600],
  );
  return { jobId, run: runs[0]! };
}

const claimOptions = (nodeId: string, extra: Partial<ClaimOptions> = {}): ClaimOptions => ({
  nodeId,
  graceMs: 5000,
  skewToleranceMs: 10,
  leadMs: 600_000,
  ...extra,
});

async function claim(
  id: string,
  nodeId: string,
  extra: Partial<ClaimOptions> = {},
  expected: number | null = null,
) {
  const [run] = await claimRuns(
    db.pool,
    [{ runId: id, expectedAttempt: expected }],
    claimOptions(nodeId, extra),
  );
  assert.ok(run, `claimed by ${nodeId}`);
  return run;
}

async function row(id: string) {
  const { rows } = await db.pool.query<{
    state: string;
    attempt: number;
    maxAttempts: number;
    startedAt: Date | null;
    claimedBy: string | null;
    notBefore: Date;
  }>(
    `SELECT state, attempt, max_attempts AS "maxAttempts", started_at AS "startedAt",
            claimed_by AS "claimedBy", not_before AS "notBefore" FROM runs WHERE id = $1`,
    [id],
  );
  return rows[0] ?? null;
}

const success = (): AttemptReport => ({
  outcome: 'succeeded',
  statusCode: 200,
  durationMs: 1,
  error: null,
  responseExcerpt: null,
});

/**
 * A worker's attempt context whose executor records each call made (not aborted), and runs
 * `during` while the call is in flight.
 */
function context(
  pool: Connections,
  nodeId: string,
  calls: string[],
  during?: (run: ClaimedRun) => Promise<void>,
): AttemptContext {
  const starts = createStartBatcher(pool, nodeId, 10);
  const executor = {
    execute: async (run: ClaimedRun, cancel: AbortSignal): Promise<AttemptReport> => {
      if (cancel.aborted) return { ...success(), outcome: 'cancelled', statusCode: null };
      calls.push(`${nodeId}:${run.id}:${run.attempt}`);
      await during?.(run);
      return success();
    },
  } as unknown as HttpExecutor;
  return {
    pool: db.pool,
    nodeId,
    executor,
    topics,
    clock: new DbClock(),
    start: (run) => starts.add({ id: run.id, attempt: run.attempt }),
    complete: (run, report) => completeSucceeded(db.pool, run, nodeId, report),
    logger: silentLogger,
    metrics: createMetrics('test'),
  };
}

async function attempt(ctx: AttemptContext, run: ClaimedRun) {
  await ctx.clock.sync(db.pool);
  await runAttempt(ctx, run, new AbortController().signal);
}

/** The reaper's uncharged re-queue of one run it holds (selectExpiredRuns), in its transaction. */
const forgive = async (client: pg.PoolClient, run: { id: string; attempt: number }) =>
  (
    await forgiveExpiredClaims(client, [{ run, error: 'taken back' }], 2, 'runs', {
      unstartedAfterMs: UNSTARTED_MS,
    })
  ).map((next) => next?.attempt === run.attempt + 1);

const expiredReport = {
  outcome: 'expired' as const,
  statusCode: null,
  durationMs: null,
  error: 'taken back',
  responseExcerpt: null,
};

test('reaper first: a START sent while the reaper holds the run waits, finds the claim gone, and no call is made; the next attempt is called once', async () => {
  const { run } = await setup();
  const claimedA = await claim(run.id, A);
  assert.equal(claimedA.startPending, true);
  await untilDbTime(db.pool, run.scheduledFor.getTime() + UNSTARTED_MS + 50);

  const calls: string[] = [];
  const client = await db.pool.connect();
  let workerDone = false;
  try {
    await client.query('BEGIN');
    const expired = await selectExpiredRuns(client, 100, { unstartedAfterMs: UNSTARTED_MS });
    assert.deepEqual(
      expired.map((r) => [r.id, r.unstarted]),
      [[run.id, true]],
    );
    // The worker, slow (its claim's grace is 5 s): it STARTs now, while the reaper holds the row.
    const worker = attempt(context(db.pool, A, calls), claimedA).then(() => (workerDone = true));
    await sleep(300);
    assert.equal(workerDone, false, 'START waits for the row the reaper holds');
    assert.deepEqual(await forgive(client, expired[0]!), [true]);
    await client.query('COMMIT');
    await worker;
  } finally {
    client.release();
  }
  assert.deepEqual(calls, [], 'A makes no call');
  const back = await row(run.id);
  assert.deepEqual(
    [back?.state, back?.attempt, back?.maxAttempts, back?.startedAt],
    ['queued', 1, 2, null],
    'queued again, uncharged, never started',
  );
  const claimedB = await claim(run.id, B, {}, 2);
  assert.equal(claimedB.startPending, false, 'due by now: started with its claim');
  await attempt(context(db.pool, B, calls), claimedB);
  assert.deepEqual(calls, [`${B}:${run.id}:2`]);
  assert.equal((await row(run.id))?.state, 'succeeded');
});

test('START first: the reaper skips the row START holds without waiting for it, and leaves the started run to its deadline', async () => {
  const { run } = await setup();
  const claimedA = await claim(run.id, A);
  await untilDbTime(db.pool, run.scheduledFor.getTime() - 50);
  const client = await db.pool.connect();
  try {
    await client.query('BEGIN');
    assert.deepEqual(await startRuns(client, A, [claimedA]), [true]);
    await untilDbTime(db.pool, run.scheduledFor.getTime() + UNSTARTED_MS + 50);
    const t0 = performance.now();
    assert.equal((await reaper().reapBatch()).reaped, 0, 'row held by START: skipped');
    assert.ok(performance.now() - t0 < 1000, 'the pass did not wait for START');
    await client.query('COMMIT');
  } finally {
    client.release();
  }
  assert.equal((await reaper().reapBatch()).reaped, 0, 'started: only its deadline counts');
  const now = await row(run.id);
  assert.deepEqual([now?.state, now?.claimedBy], ['running', A]);
  assert.ok(now?.startedAt);
});

for (const commit of [true, false]) {
  test(`START's answer lost (${commit ? 'after' : 'before'} it committed), the reaper's pass past the line in between, then the one-by-one retry: ${commit ? 'A calls, the reaper left it' : 'A does not call, B calls attempt 2'}`, async () => {
    const { run } = await setup();
    const claimedA = await claim(run.id, A);
    const calls: string[] = [];
    let reaped = -1;
    let starts = 0;
    const pool = {
      connect: () => db.pool.connect(),
      query: (async (config: pg.QueryConfig, values?: unknown[]) => {
        const isStart = typeof config === 'object' && config?.name === 'helios-start-runs';
        if (isStart && ++starts === 1) {
          if (commit) await db.pool.query(config, values);
          await untilDbTime(db.pool, run.scheduledFor.getTime() + UNSTARTED_MS + 50);
          reaped = (await reaper().reapBatch()).reaped;
          throw new Error('Connection terminated unexpectedly');
        }
        return db.pool.query(config, values);
      }) as unknown as pg.Pool['query'],
    };
    await untilDbTime(db.pool, run.scheduledFor.getTime());
    await attempt(context(pool, A, calls), claimedA);
    assert.ok(starts >= 2, 'START was tried again one by one');
    if (commit) {
      assert.equal(reaped, 0, 'the reaper left the started run');
      assert.deepEqual(calls, [`${A}:${run.id}:1`]);
      assert.equal((await row(run.id))?.state, 'succeeded');
      return;
    }
    assert.equal(reaped, 1, 'the reaper took the unstarted run back');
    assert.deepEqual(calls, [], 'the retry found the claim gone');
    const claimedB = await claim(run.id, B, {}, 2);
    await attempt(context(db.pool, B, calls), claimedB);
    assert.deepEqual(calls, [`${B}:${run.id}:2`], 'called once, by B');
  });
}

test("START's batch with a stale attempt taken back, the same run's current attempt and another run claimed ahead: only the current ones start, and the reaper leaves those", async () => {
  const r = await setup({ dueInMs: 600 });
  const s = await setup({ dueInMs: 600 + UNSTARTED_MS + 400 });
  const r1 = await claim(r.run.id, A);
  const s1 = await claim(s.run.id, A);
  await untilDbTime(db.pool, r.run.scheduledFor.getTime() + UNSTARTED_MS + 50);
  assert.equal((await reaper().reapBatch()).reaped, 1, 'r taken back; s is not past its line yet');
  const r2 = await claim(r.run.id, A, {}, 2);
  assert.equal(r2.startPending, false);
  await untilDbTime(db.pool, s.run.scheduledFor.getTime());
  assert.deepEqual(await startRuns(db.pool, A, [r1, r2, s1]), [false, true, true]);
  await untilDbTime(db.pool, s.run.scheduledFor.getTime() + UNSTARTED_MS + 50);
  assert.equal((await reaper().reapBatch()).reaped, 0, 'started runs keep their claims');
  assert.equal((await row(s.run.id))?.claimedBy, A);
  assert.deepEqual([(await row(r.run.id))?.claimedBy, (await row(r.run.id))?.attempt], [A, 2]);
});

/**
 * Every way a run gets claimed, then its worker's attempt (runAttempt, real START batcher): while
 * its call is in flight, past the reaper's line for a run due when this run is, a reaper pass must
 * not take it back (a second call). Returns the claim the worker runs.
 */
const claimPaths: Record<string, () => Promise<{ id: string; claimed: ClaimedRun; nodeId: string }>> = {
  'claimed ahead (first attempt: START before its call)': async () => {
    const { run } = await setup();
    const claimed = await claim(run.id, A);
    assert.equal(claimed.startPending, true);
    await untilDbTime(db.pool, run.scheduledFor.getTime());
    return { id: run.id, claimed, nodeId: A };
  },
  'claimed when due': async () => {
    const { run } = await setup({ dueInMs: 0 });
    return { id: run.id, claimed: await claim(run.id, A, { leadMs: 0 }), nodeId: A };
  },
  'claimed by the polling fallback': async () => {
    const { run } = await setup({ dueInMs: -50 });
    const { claimed } = await inTransaction(db.pool, (c) => claimOverdueRuns(c, 0, 100, claimOptions(A)));
    const mine = claimed.find((c) => c.id === run.id);
    assert.ok(mine);
    return { id: run.id, claimed: mine, nodeId: A };
  },
  'a manual trigger': async () => {
    const { jobId } = await setup({ dueInMs: 3_600_000 });
    const id = (await createManualRun(db.pool, jobId, 'runs')).runId;
    assert.ok(id);
    return { id, claimed: await claim(id, A), nodeId: A };
  },
  'a replayed dead letter whose run was never called': async () => {
    const { run } = await setup();
    const first = await claim(run.id, A);
    const dead = await inTransaction(db.pool, (c) =>
      failAttempt(
        c,
        first,
        { nodeId: A },
        { ...expiredReport, outcome: 'failed', retryable: false },
        0,
        topics,
      ),
    );
    assert.equal(dead?.state, 'dead');
    const replayed = await replayDeadLetter(db.pool, (dead as { deadLetterId: string }).deadLetterId, {
      runsTopic: 'runs',
    });
    assert.ok(replayed);
    return { id: run.id, claimed: await claim(run.id, B), nodeId: B };
  },
  'a retry claimed ahead of its backoff (attempt 1 started)': async () => {
    const { run } = await setup({ dueInMs: 0, maxAttempts: 3 });
    const first = await claim(run.id, A);
    assert.equal(first.startPending, false);
    const retry = await inTransaction(db.pool, (c) =>
      failAttempt(c, first, { nodeId: A }, { ...expiredReport, outcome: 'failed' }, 800, topics),
    );
    assert.equal(retry?.state, 'queued');
    const second = await claim(run.id, B, {}, 2);
    assert.equal(second.notBefore > new Date(await dbNow(db.pool)), true, 'claimed ahead of its time');
    await untilDbTime(db.pool, second.notBefore.getTime());
    return { id: run.id, claimed: second, nodeId: B };
  },
  'handed back before its time and claimed ahead again': async () => {
    const { run } = await setup({ dueInMs: 1000 });
    const first = await claim(run.id, A);
    assert.ok(
      await inTransaction(db.pool, (c) =>
        releaseClaim(c, first, A, { ...expiredReport, outcome: 'cancelled' }, 'runs'),
      ),
    );
    const second = await claim(run.id, B, {}, 2);
    assert.equal(second.startPending, true);
    await untilDbTime(db.pool, run.scheduledFor.getTime());
    return { id: run.id, claimed: second, nodeId: B };
  },
  'taken back unstarted by the reaper, then claimed again': async () => {
    const { run } = await setup();
    await claim(run.id, A);
    await untilDbTime(db.pool, run.scheduledFor.getTime() + UNSTARTED_MS + 50);
    assert.equal((await reaper().reapBatch()).reaped, 1);
    return { id: run.id, claimed: await claim(run.id, B, {}, 2), nodeId: B };
  },
  'a forbid run': async () => {
    const { run } = await setup({ dueInMs: 0, concurrency: 'forbid' });
    return { id: run.id, claimed: await claim(run.id, A), nodeId: A };
  },
  'a replace run claimed within the skew tolerance before its time': async () => {
    const { run } = await setup({ dueInMs: 150, concurrency: 'replace' });
    await untilDbTime(db.pool, run.scheduledFor.getTime() - 100);
    const claimed = await claim(run.id, A, { skewToleranceMs: 200 });
    assert.equal(claimed.startPending, true, 'not due yet: START before its call');
    await untilDbTime(db.pool, run.scheduledFor.getTime());
    return { id: run.id, claimed, nodeId: A };
  },
};

for (const [path, make] of Object.entries(claimPaths)) {
  test(`call in flight, ${path}: a reaper pass past the line leaves it; called once`, async () => {
    const { id, claimed, nodeId } = await make();
    const calls: string[] = [];
    let reapedDuringCall = -1;
    const ctx = context(db.pool, nodeId, calls, async () => {
      const { rows } = await db.pool.query<{ nb: Date }>('SELECT not_before AS nb FROM runs WHERE id = $1', [
        id,
      ]);
      await untilDbTime(
        db.pool,
        Math.max(rows[0]!.nb.getTime(), claimed.notBefore.getTime()) + UNSTARTED_MS + 50,
      );
      reapedDuringCall = (await reaper().reapBatch()).reaped;
    });
    await attempt(ctx, claimed);
    assert.deepEqual(calls, [`${nodeId}:${id}:${claimed.attempt}`], 'called once');
    assert.equal(reapedDuringCall, 0, 'the reaper took back no run whose call was in flight');
    assert.equal((await row(id))?.state, 'succeeded');
  });
}

test('a pause while the reaper holds a run that fell due: it waits only for that pass, withdraws only the later run claimed ahead, and the due one is re-queued and called once', async () => {
  const { jobId, run } = await setup();
  const later = await db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, now() + interval '20 s', 'queued', 1, target, timeout_ms, 0, 2, 'allow', now() + interval '20 s'
     FROM jobs WHERE id = $1 RETURNING id`,
    [jobId],
  );
  const laterId = later.rows[0]!.id;
  await claim(run.id, A);
  await claim(laterId, A);
  await untilDbTime(db.pool, run.scheduledFor.getTime() + UNSTARTED_MS + 50);
  const client = await db.pool.connect();
  let pause: Promise<unknown> | undefined;
  try {
    await client.query('BEGIN');
    const expired = await selectExpiredRuns(client, 100, { unstartedAfterMs: UNSTARTED_MS });
    assert.deepEqual(
      expired.map((r) => r.id),
      [run.id],
      'only the run past the line',
    );
    // The pause's findJob FOR UPDATE waits for the reaper's key-share lock on the job: one pass.
    pause = pauseJob(db.pool, { id: jobId }, COMMANDS);
    await sleep(200);
    assert.deepEqual(await forgive(client, expired[0]!), [true]);
    await client.query('COMMIT');
  } catch (err) {
    await client.query('ROLLBACK');
    throw err;
  } finally {
    client.release();
  }
  assert.equal(((await pause) as { enabled: boolean } | null)?.enabled, false);
  assert.equal(await row(laterId), null, 'the later occurrence claimed ahead was withdrawn');
  const owed = await row(run.id);
  assert.equal(owed?.state, 'queued', 'the occurrence due while enabled is owed');
  const calls: string[] = [];
  await attempt(context(db.pool, B, calls), await claim(run.id, B, {}, 2));
  assert.deepEqual(calls, [`${B}:${run.id}:2`]);
});

test('a held job keeps an unstarted run past the line from the reaper: the loop looks again every 100 ms, not in a tight loop', async () => {
  const { jobId, run } = await setup();
  await claim(run.id, A);
  await untilDbTime(db.pool, run.scheduledFor.getTime() + UNSTARTED_MS + 50);
  const holder = await db.pool.connect();
  const stop = new AbortController();
  let passes = 0;
  const counting = new Proxy(db.pool, {
    get(target, prop, receiver) {
      // pg's Pool.query checks a client out with a callback: only the promise form is wrapped.
      if (prop === 'connect')
        return async (...args: unknown[]) => {
          if (args.length > 0) return (target.connect as (...a: unknown[]) => unknown)(...args);
          const c = await target.connect();
          const query = c.query.bind(c);
          return new Proxy(c, {
            get: (t, p) =>
              p === 'query'
                ? (text: unknown, ...rest: unknown[]) => {
                    if (typeof text === 'string' && text.includes('never_started')) passes += 1;
                    return (query as (...a: unknown[]) => unknown)(text, ...rest);
                  }
                : Reflect.get(t, p),
          });
        };
      return Reflect.get(target, prop, receiver);
    },
  });
  try {
    await holder.query('BEGIN');
    await holder.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [jobId]);
    const loop = reaper(counting, stop.signal).run();
    await sleep(1000);
    assert.equal((await row(run.id))?.state, 'running', 'left while its job is held');
    assert.ok(passes >= 3 && passes <= 15, `${passes} passes in 1 s`);
    await holder.query('COMMIT');
    await sleep(400);
    assert.equal((await row(run.id))?.state, 'queued', 'taken back once the job is free');
    stop.abort();
    await loop;
  } finally {
    stop.abort();
    await holder.query('ROLLBACK').catch(() => undefined);
    holder.release();
  }
});

test("one reaper pass key-share-locks the jobs of the runs it takes, not of every unstarted run past the line (a killed worker's herd)", async () => {
  const N = 1000;
  await db.pool.query(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms)
       SELECT 'herd-' || g || '-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 1, 0
       FROM generate_series(1, $1) g`,
    [N],
  );
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                         backoff_multiplier, concurrency, not_before, claimed_by, attempt, claim_expires_at)
       SELECT id, now() - interval '1 s', 'running', 1, target, 1000, 0, 2, 'allow', now() - interval '1 s',
              'killed', 1, now() + interval '5 s'
       FROM jobs WHERE name LIKE 'herd-%'`,
  );
  const client = await db.pool.connect();
  try {
    // Whatever join the planner picks: a hash join scanning every running run (as CI's statistics
    // once chose) must not lock their jobs either.
    for (const plan of ['SELECT 1', 'SET LOCAL enable_nestloop = off']) {
      await client.query('BEGIN');
      await client.query(plan);
      const taken = await selectExpiredRuns(client, 100, { unstartedAfterMs: UNSTARTED_MS });
      assert.equal(taken.length, 100);
      const { rows } = await db.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM (SELECT id FROM jobs WHERE name LIKE 'herd-%' FOR UPDATE SKIP LOCKED) f`,
      );
      assert.ok(rows[0]!.n >= N - 100, `${plan}: ${N - rows[0]!.n} jobs locked by a pass that took 100 runs`);
      await client.query('ROLLBACK');
    }
  } finally {
    await client.query('ROLLBACK');
    client.release();
    await db.pool.query(`DELETE FROM jobs WHERE name LIKE 'herd-%'`);
  }
});
