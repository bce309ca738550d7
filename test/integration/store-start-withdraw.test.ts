import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type pg from 'pg';
import { releaseClaim } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { withdrawFutureRuns } from '../../src/store/jobs.js';
import { claimRuns, startRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { waitFor } from '../support/execution.js';

// A run claimed ahead of its time is either started by its worker (startRuns: its call may begin)
// or withdrawn by a pause or an edit (withdrawFutureRuns), never both: a withdrawn run that was
// called would be a call with no run (and, after an edit, a second call for the same occurrence
// from the run created again). Both statements write the row, so the one that commits second sees
// the first: these tests hold one side's transaction open while the other runs.

let db: TestDatabase;
const NODE = 'node-a';
/** Claimed up to ten minutes ahead, so every run here is claimed ahead of its time. */
const options = { nodeId: NODE, graceMs: 5000, skewToleranceMs: 10, leadMs: 600_000 };

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** A job with `count` scheduled runs due in 30 s, claimed ahead by NODE. */
async function claimedAheadRuns(count: number): Promise<{ jobId: string; runs: ClaimedRun[] }> {
  const { rows: jobs } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts)
     VALUES ('start-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3) RETURNING id`,
  );
  const jobId = jobs[0]!.id;
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT $1, t, 'queued', 3, '{"url":"http://127.0.0.1:9/"}', 1000, 100, 2, 'allow', t
     FROM (SELECT date_trunc('second', now()) + interval '30 seconds' + n * interval '1 second' AS t
           FROM generate_series(1, $2) AS n) s
     RETURNING id`,
    [jobId, count],
  );
  const claimed = await claimRuns(
    db.pool,
    rows.map((r) => ({ runId: r.id, expectedAttempt: 1 })),
    options,
  );
  const runs = claimed.filter((r): r is ClaimedRun => r !== null);
  assert.equal(runs.length, count);
  assert.ok(
    runs.every((r) => r.startPending),
    'a run claimed ahead of its time is not started by its claim',
  );
  return { jobId, runs };
}

/** Waits until a statement of this database waits for a row lock. */
async function untilBlocked(): Promise<void> {
  await waitFor('a statement waiting for a row lock', async () => {
    const { rows } = await db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM pg_stat_activity
       WHERE datname = current_database() AND wait_event_type = 'Lock'`,
    );
    return rows[0]!.n > 0;
  });
}

async function existing(ids: readonly string[]): Promise<{ id: string; startedAt: Date | null }[]> {
  const { rows } = await db.pool.query<{ id: string; startedAt: Date | null }>(
    'SELECT id, started_at AS "startedAt" FROM runs WHERE id = ANY($1::uuid[])',
    [ids],
  );
  return rows;
}

async function inOpenTransaction<T>(work: (client: pg.PoolClient) => Promise<T>) {
  const client = await db.pool.connect();
  await client.query('BEGIN');
  const result = await work(client);
  return {
    result,
    commit: async () => {
      await client.query('COMMIT');
      client.release();
    },
  };
}

test('a pause that withdrew a claimed-ahead run first: its worker finds nothing to start', async () => {
  const { jobId, runs } = await claimedAheadRuns(3);
  const pause = await inOpenTransaction((c) => withdrawFutureRuns(c, jobId));
  assert.notEqual(pause.result.earliest, null, 'the pause withdrew runs');
  const starting = startRuns(db.pool, NODE, runs);
  await untilBlocked();
  await pause.commit();
  assert.deepEqual(await starting, [false, false, false], 'no withdrawn run may be called');
  assert.deepEqual(await existing(runs.map((r) => r.id)), []);
});

test('a worker that started a claimed-ahead run first: a pause leaves it to run', async () => {
  const { jobId, runs } = await claimedAheadRuns(3);
  const start = await inOpenTransaction((c) => startRuns(c, NODE, runs));
  assert.deepEqual(start.result, [true, true, true]);
  // In a transaction, as the pause command runs it: its lock in id order holds until the delete.
  const withdrawing = inTransaction(db.pool, (c) => withdrawFutureRuns(c, jobId));
  await untilBlocked();
  await start.commit();
  assert.equal((await withdrawing).earliest, null, 'the pause withdrew no started run');
  const left = await existing(runs.map((r) => r.id));
  assert.equal(left.length, 3, 'the started runs are kept');
  assert.ok(left.every((r) => r.startedAt !== null));
});

test('a pause and the start of the same runs at once: each run is started or withdrawn, never both', async () => {
  for (let round = 0; round < 10; round++) {
    const { jobId, runs } = await claimedAheadRuns(40);
    // Half the runs start in one statement, the other half in another, racing the pause.
    const [first, second] = [runs.slice(0, 20), runs.slice(20)];
    const [a, , b] = await Promise.all([
      startRuns(db.pool, NODE, first),
      inTransaction(db.pool, (c) => withdrawFutureRuns(c, jobId)),
      startRuns(db.pool, NODE, second),
    ]);
    const started = new Set(runs.filter((_, i) => (i < 20 ? a[i] : b[i - 20])).map((r) => r.id));
    const left = new Set((await existing(runs.map((r) => r.id))).map((r) => r.id));
    for (const run of runs) {
      assert.equal(
        left.has(run.id),
        started.has(run.id),
        `round ${round}: run ${run.id} ${started.has(run.id) ? 'started' : 'not started'} and ${left.has(run.id) ? 'kept' : 'withdrawn'}`,
      );
    }
  }
});

test('a run claimed ahead and handed back uncalled (a stopping worker) is withdrawn by a pause', async () => {
  const { jobId, runs } = await claimedAheadRuns(2);
  const report = {
    outcome: 'cancelled' as const,
    statusCode: null,
    durationMs: null,
    error: 'worker stopping',
    responseExcerpt: null,
  };
  for (const run of runs) {
    const next = await inTransaction(db.pool, (c) => releaseClaim(c, run, NODE, report, 'runs'));
    assert.equal(next?.attempt, 2, 'handed back, announced again');
  }
  assert.notEqual((await withdrawFutureRuns(db.pool, jobId)).earliest, null);
  assert.deepEqual(await existing(runs.map((r) => r.id)), [], 'never called, so withdrawn like a queued run');
});

test('START is repeatable (a retry after a lost answer): the run stays started at its first time; another node or a later attempt cannot start it', async () => {
  const { jobId, runs } = await claimedAheadRuns(2);
  assert.deepEqual(await startRuns(db.pool, NODE, runs), [true, true]);
  const startedAt = async () =>
    new Map((await existing(runs.map((r) => r.id))).map((r) => [r.id, r.startedAt?.getTime()]));
  const first = await startedAt();
  assert.deepEqual(await startRuns(db.pool, NODE, runs), [true, true], 'a retry finds them started');
  assert.deepEqual(await startedAt(), first, 'started_at is not moved by the retry');
  assert.deepEqual(await startRuns(db.pool, 'node-b', runs), [false, false], 'another node holds no claim');
  const stale = runs.map((r) => ({ id: r.id, attempt: r.attempt + 1 }));
  assert.deepEqual(await startRuns(db.pool, NODE, stale), [false, false], 'no such attempt');
  assert.equal((await withdrawFutureRuns(db.pool, jobId)).earliest, null, 'started runs are kept');
});

test('a START whose plan meets its runs out of id order and a pause: no deadlock, each run started or withdrawn', async () => {
  // START's UPDATE meets rows in its plan's order: on a small table a hash join over a scan of
  // runs, in physical order. Two runs of one job where the higher id lies physically first; a
  // third transaction holds the lower one. The pause (locking by id) queues for it; START, planned
  // as a hash join, takes the higher one and queues too. Once the holder commits, the pause takes
  // the lower run and wants the higher, held by START, which waits for the pause: a deadlock,
  // unless START too locks by id first.
  let pair: { jobId: string; high: ClaimedRun; low: ClaimedRun } | undefined;
  while (!pair) {
    const { jobId, runs } = await claimedAheadRuns(6);
    const { rows } = await db.pool.query<{ id: string }>(
      'SELECT id FROM runs WHERE id = ANY($1::uuid[]) ORDER BY ctid',
      [runs.map((r) => r.id)],
    );
    // Two runs out of id order physically (all six in order: 1 in 720).
    const at = rows.findIndex((r, i) => i > 0 && r.id < rows[i - 1]!.id);
    const byId = (id: string) => runs.find((r) => r.id === id)!;
    if (at > 0) pair = { jobId, high: byId(rows[at - 1]!.id), low: byId(rows[at]!.id) };
  }
  const { jobId, high, low } = pair;
  const holder = await inOpenTransaction((c) =>
    c.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE', [low.id]),
  );
  const pausing = inTransaction(db.pool, (c) => withdrawFutureRuns(c, jobId));
  await untilBlocked();
  const starter = await db.pool.connect();
  try {
    await starter.query('SET enable_nestloop = off; SET enable_mergejoin = off');
    const starting = startRuns(starter, NODE, [high, low]);
    await waitFor('START waiting too', async () => {
      const { rows: waiting } = await db.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'`,
      );
      return waiting[0]!.n >= 2;
    });
    await holder.commit();
    const [started, withdrawal] = await Promise.all([starting, pausing]);
    const left = await existing([low.id, high.id]);
    // The pause went first on the lower run: START finds both gone.
    assert.deepEqual(started, [false, false], 'withdrawn before START reached them');
    assert.deepEqual(left, []);
    assert.notEqual(withdrawal.earliest, null);
  } finally {
    await starter.query('RESET enable_nestloop; RESET enable_mergejoin').catch(() => undefined);
    starter.release();
  }
});
