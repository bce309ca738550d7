import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import type pg from 'pg';
import { completeSucceededMany, releaseClaim } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { deleteJob, withdrawFutureRuns } from '../../src/store/jobs.js';
import { claimRuns, replaceOlderRuns, startRuns, type ClaimedRun } from '../../src/store/runs.js';
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

/** A job with `count` scheduled runs due in 30 s, queued. */
async function futureRuns(count: number): Promise<{ jobId: string; ids: string[] }> {
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
  return { jobId, ids: rows.map((r) => r.id) };
}

/** A job with `count` scheduled runs due in 30 s, claimed ahead by NODE. */
async function claimedAheadRuns(count: number): Promise<{ jobId: string; runs: ClaimedRun[] }> {
  const { jobId, ids } = await futureRuns(count);
  const claimed = await claimRuns(
    db.pool,
    ids.map((runId) => ({ runId, expectedAttempt: 1 })),
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
    client,
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
  assert.notEqual((await inTransaction(db.pool, (c) => withdrawFutureRuns(c, jobId))).earliest, null);
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
  assert.equal(
    (await inTransaction(db.pool, (c) => withdrawFutureRuns(c, jobId))).earliest,
    null,
    'started runs are kept',
  );
});

/**
 * A batch (a claim or a START) that takes two runs of a job in the reverse of the order in which a
 * command (a pause, a delete) locks them, as one statement does when its plan meets them that way
 * (on a small table, a hash join over a scan of runs, in physical order; a pause locks by id).
 * Here the batch takes them in two statements of one transaction, so its order does not depend on
 * a plan: the batch holds the second run; the command takes the first and waits for the second;
 * the batch then waits for the first. A deadlock, which PostgreSQL breaks after deadlock_timeout
 * (1 s) by failing one side, unless the command lets go first: the batch's wait must end well
 * before that (a command that only retried when PostgreSQL failed it would pass otherwise).
 */
async function crossLockOrders<T, C>(
  command: (client: pg.PoolClient) => Promise<C>,
  [first, second]: readonly [string, string],
  batch: (client: pg.PoolClient, id: string) => Promise<T>,
): Promise<{ batched: T[]; commanded: C }> {
  const batching = await inOpenTransaction((c) => batch(c, second));
  const commanding = inTransaction(db.pool, command);
  await untilBlocked();
  const waitFrom = performance.now();
  const again = await batch(batching.client, first);
  const waitedMs = performance.now() - waitFrom;
  await batching.commit();
  const commanded = await commanding;
  assert.ok(waitedMs < 500, `the batch waited ${Math.round(waitedMs)} ms for the command to let go`);
  return { batched: [again, batching.result], commanded };
}

/** Two of the job's runs, lower id first. */
const byId = (ids: readonly string[]) => [...ids].sort().slice(0, 2) as [string, string];

test("a START that takes a job's runs out of id order and a pause: no deadlock, the pause yields to START", async () => {
  const { jobId, runs } = await claimedAheadRuns(3);
  const pair = byId(runs.map((r) => r.id));
  const { batched, commanded: withdrawal } = await crossLockOrders(
    (c) => withdrawFutureRuns(c, jobId),
    pair,
    async (c, id) => {
      const [started] = await startRuns(c, NODE, [{ id, attempt: 1 }]);
      return started;
    },
  );
  // The pause held the lower run and waited for the higher one (START's): it let go, START took
  // both, and the pause's next try found them started.
  assert.deepEqual(batched, [true, true], 'started');
  const left = await existing(pair);
  assert.equal(left.length, 2, 'a started run is not withdrawn');
  assert.ok(left.every((r) => r.startedAt !== null));
  assert.notEqual(withdrawal.earliest, null, "the job's third run, never started, is withdrawn");
});

test("a claim that takes a job's runs out of id order and a pause: no deadlock, the claimed runs are withdrawn", async () => {
  const { jobId, ids } = await futureRuns(2);
  const pair = byId(ids);
  const { batched, commanded: withdrawal } = await crossLockOrders(
    (c) => withdrawFutureRuns(c, jobId),
    pair,
    async (c, runId) => {
      const [claimed] = await claimRuns(c, [{ runId, expectedAttempt: 1 }], options);
      return claimed?.id;
    },
  );
  // The claim took both (claimed ahead, not started); the pause's next try withdrew them, so
  // their worker's START finds nothing.
  assert.deepEqual(batched, pair, 'claimed');
  assert.notEqual(withdrawal.earliest, null, 'claimed ahead and not started: withdrawn');
  assert.deepEqual(await existing(pair), []);
  assert.deepEqual(
    await startRuns(
      db.pool,
      NODE,
      pair.map((id) => ({ id, attempt: 1 })),
    ),
    [false, false],
  );
});

test("a withdrawal that yielded to a held run restores the transaction's lock_timeout and leaves no savepoint open", async () => {
  const { jobId, runs } = await claimedAheadRuns(2);
  // Held past several of the withdrawal's waits, so it lets go and tries again more than once.
  const holder = await inOpenTransaction((c) => startRuns(c, NODE, runs.slice(0, 1)));
  const releasing = sleep(180).then(() => holder.commit());
  const { withdrawal, after, transactionIds } = await inTransaction(db.pool, async (c) => {
    await c.query(`SET LOCAL lock_timeout = '7s'`);
    const withdrawal = await withdrawFutureRuns(c, jobId);
    const { rows } = await c.query<{ lock_timeout: string }>('SHOW lock_timeout');
    // A savepoint of the tries still open would nest the rest of the command in subtransactions:
    // each open level that wrote (locked rows) holds a transaction id (a released one lets go of
    // it), the top level one more.
    const { rows: ids } = await c.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'transactionid'`,
    );
    return { withdrawal, after: rows[0]!.lock_timeout, transactionIds: ids[0]!.n };
  });
  await releasing;
  assert.equal(after, '7s', 'the rest of the command waits for locks as before');
  assert.equal(transactionIds, 1, 'the transaction alone holds one: no savepoint of the tries is left open');
  assert.notEqual(withdrawal.earliest, null, 'the run not started is withdrawn');
  assert.deepEqual(
    (await existing(runs.map((r) => r.id))).map((r) => r.id),
    [runs[0]!.id],
    'the started run is kept',
  );
});

test("a job deleted while a batch takes its runs in the reverse of the delete's order: no deadlock, the delete yields", async () => {
  // Two runs whose physical order (the order the cascade of a delete meets them in on this small
  // table) is also their id order (the order the delete now locks them in), so that the batch,
  // taking them the other way round, crosses both.
  let picked: { jobId: string; scan: [string, string] } | undefined;
  while (!picked) {
    const { jobId, runs } = await claimedAheadRuns(4);
    const { rows } = await db.pool.query<{ id: string }>(
      'SELECT id FROM runs WHERE id = ANY($1::uuid[]) ORDER BY ctid',
      [runs.map((r) => r.id)],
    );
    const at = rows.findIndex((r, i) => i > 0 && r.id > rows[i - 1]!.id);
    if (at > 0) picked = { jobId, scan: [rows[at - 1]!.id, rows[at]!.id] };
  }
  const { jobId, scan } = picked;
  const { batched, commanded: deleted } = await crossLockOrders(
    (c) => deleteJob(c, jobId),
    scan,
    async (c, id) => (await startRuns(c, NODE, [{ id, attempt: 1 }]))[0],
  );
  assert.deepEqual(batched, [true, true], 'START went on');
  assert.equal(deleted, true, 'and the job was deleted after it');
  assert.deepEqual(await existing(scan), [], 'with its runs');
});

test('a job deleted while a pause of it holds the job and then takes its runs: the delete waits its turn', async () => {
  const { jobId } = await claimedAheadRuns(2);
  // The pause command locks the job's row first (findJob … FOR UPDATE), then its runs.
  const pause = await inOpenTransaction((c) =>
    c.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [jobId]),
  );
  const deleting = inTransaction(db.pool, (c) => deleteJob(c, jobId));
  await untilBlocked();
  // A delete that had locked the runs before the job would now hold what the pause needs while it
  // waits for the pause's row.
  const withdrawal = await withdrawFutureRuns(pause.client, jobId);
  await pause.commit();
  assert.notEqual(withdrawal.earliest, null, 'the pause withdrew the runs');
  assert.equal(await deleting, true, 'then the delete deleted the job');
});

test('a job deleted while a completion batch holds a run another writer finished under it: the delete yields', async () => {
  // A `replace` job with two running runs of NODE: x (older) and a.
  const { rows: jobs } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency)
     VALUES ('start-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3, 'replace')
     RETURNING id`,
  );
  const jobId = jobs[0]!.id;
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before, claimed_by, claim_expires_at, started_at)
     SELECT $1, t, 'running', 1, 3, '{"url":"http://127.0.0.1:9/"}', 1000, 100, 2, 'replace', t, $2,
            now() + interval '1 minute', t
     FROM (VALUES (now() - interval '3 seconds'), (now() - interval '1 second')) AS s (t)
     ORDER BY t RETURNING id`,
    [jobId, NODE],
  );
  const [x, a] = rows.map((r) => r.id) as [string, string];
  await db.pool.query(
    `INSERT INTO run_attempts (run_id, attempt, node_id) SELECT unnest($1::uuid[]), 1, $2`,
    [[x, a], NODE],
  );
  const report = {
    outcome: 'succeeded' as const,
    statusCode: 200,
    durationMs: 5,
    error: null,
    responseExcerpt: null,
  };
  // A newer run fails x as replaced; a completion batch waits for x meanwhile. x no longer matches
  // once the replace commits, but the batch keeps the row it waited for locked. The batch is two
  // statements of one transaction here, so that it reaches a (which the delete takes) afterwards.
  const replacing = await inOpenTransaction((c) => replaceOlderRuns(c, jobId));
  assert.deepEqual(replacing.result.replaced, [x]);
  const batch = await inOpenTransaction(async () => undefined);
  const first = completeSucceededMany(batch.client, NODE, [{ run: { id: x, attempt: 1 }, report }]);
  await untilBlocked();
  await replacing.commit();
  assert.deepEqual(await first, [false], 'x was replaced: not completed');
  // The delete's cascade takes a, then waits for x (held by the batch), which waits for a.
  const deleting = inTransaction(db.pool, (c) => deleteJob(c, jobId));
  await untilBlocked();
  const waitFrom = performance.now();
  const second = await completeSucceededMany(batch.client, NODE, [{ run: { id: a, attempt: 1 }, report }]);
  const waitedMs = performance.now() - waitFrom;
  await batch.commit();
  assert.equal(await deleting, true);
  assert.deepEqual(second, [true], 'a completed, then deleted with its job');
  assert.ok(waitedMs < 500, `the batch waited ${Math.round(waitedMs)} ms for the delete to let go`);
});
