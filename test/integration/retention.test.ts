import assert from 'node:assert/strict';
import { performance } from 'node:perf_hooks';
import { after, before, test } from 'node:test';
import pg from 'pg';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { Pruner, type PrunerOptions } from '../../src/retention/pruner.js';
import { createPool } from '../../src/store/db.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { insertJob } from '../support/execution.js';
import { parseMetrics } from '../support/metrics.js';

// Retention against the real database: what goes, what stays.

let db: TestDatabase;
before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

const DAY = 86_400_000;

/** A pruner keeping 30 days and each job's newest 3, on the test database unless `options` say otherwise. */
function pruner(options: Partial<PrunerOptions> = {}) {
  return new Pruner({
    pool: db.pool,
    signal: new AbortController().signal,
    retention: { runsMs: 30 * DAY, keepPerJob: 3, outboxMs: 600_000 },
    logger: silentLogger,
    metrics: createMetrics('retention-test'),
    ...options,
  });
}

/**
 * `count` succeeded manual runs of job `jobId` finished past the retention: the first due 40 days
 * ago plus `first` steps, one every `stepMs`.
 */
async function finishedManualRuns(jobId: string, count: number, { first = 0, stepMs = 1000 } = {}) {
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, trigger, state, attempt, max_attempts, target, timeout_ms,
                       backoff_ms, backoff_multiplier, not_before, finished_at)
     SELECT $1, t, 'manual', 'succeeded', 1, 3, '{"url":"http://127.0.0.1:9/"}', 1000, 0, 2, t, t + interval '1 second'
     FROM (SELECT now() - interval '40 days' + ($3 + i) * ($4 * interval '1 millisecond') AS t
           FROM generate_series(0, $2 - 1) i) s`,
    [jobId, count, first, stepMs],
  );
}

/** `count` outbox rows keyed `key`, published 11 minutes ago: past the 10 minutes kept. */
async function publishedOutboxRows(key: string, count: number) {
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload, published_at)
     SELECT 't', $1, '{}', now() - interval '11 minutes' FROM generate_series(1, $2)`,
    [key, count],
  );
}

/** `count` finished runs of a job, one a day, the newest `newestDaysAgo` days ago. */
async function history(jobId: string, count: number, newestDaysAgo: number, state = 'succeeded') {
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before, finished_at)
     SELECT $1, t, $4, 1, 3, '{"url":"http://127.0.0.1:9/"}', 1000, 0, 2, t, t + interval '1 second'
     FROM (SELECT now() - ($3 + i) * interval '1 day' AS t FROM generate_series(0, $2 - 1) i) s`,
    [jobId, count, newestDaysAgo, state],
  );
  await db.pool.query(
    `INSERT INTO run_attempts (run_id, attempt, node_id, started_at, outcome)
     SELECT id, 1, 'n', scheduled_for, 'succeeded' FROM runs WHERE job_id = $1 AND attempt = 1
     ON CONFLICT DO NOTHING`,
    [jobId],
  );
}

async function runsOfJob(jobId: string) {
  const { rows } = await db.pool.query<{ n: number; oldest: Date }>(
    `SELECT count(*)::int AS n, min(scheduled_for) AS oldest FROM runs WHERE job_id = $1`,
    [jobId],
  );
  return rows[0]!;
}

async function job(name: string): Promise<string> {
  return insertJob(db.pool, {
    name,
    schedule: '0 0 * * *',
    target: { url: 'http://127.0.0.1:9/' },
    nextRunAt: new Date(Date.now() + DAY),
  });
}

test('finished runs past the retention are pruned with their attempts; the newest N of each job stay', async () => {
  const busy = await job('busy');
  await history(busy, 60, 0); // 60 daily runs, 0 to 59 days old: 29 of them (31 days and older) past the retention
  const quiet = await job('quiet');
  await history(quiet, 5, 200); // has not fired for 200 days: everything is past the retention
  const pruned = await pruner().sweepRuns();
  assert.equal(pruned, 29 + 2, 'past the retention: 29 of busy, and all but the newest 3 of quiet');
  const b = await runsOfJob(busy);
  assert.equal(b.n, 31);
  assert.ok(b.oldest.getTime() > Date.now() - 30 * DAY - 60_000, 'nothing older than the retention is left');
  const q = await runsOfJob(quiet);
  assert.equal(q.n, 3, 'a job that has not fired for longer than the retention keeps its last 3 runs');
  const { rows } = await db.pool.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM run_attempts a WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = a.run_id)`,
  );
  assert.equal(rows[0]!.n, 0, 'attempts go with their runs');
  assert.equal(await pruner().sweepRuns(), 0, 'a second sweep finds nothing');
});

test('unfinished runs and dead runs with an open dead letter are never pruned', async () => {
  const id = await job('keeps');
  await history(id, 10, 100, 'dead');
  await db.pool.query(
    `INSERT INTO dead_letters (run_id, job_id, attempt, error)
     SELECT id, job_id, 1, 'x' FROM runs WHERE job_id = $1 ORDER BY scheduled_for LIMIT 4`,
    [id],
  );
  await db.pool.query(
    `UPDATE dead_letters SET replayed_at = now() WHERE run_id IN (
       SELECT id FROM runs WHERE job_id = $1 ORDER BY scheduled_for LIMIT 1)`,
    [id],
  );
  await db.pool.query(
    `UPDATE runs SET state = 'queued' WHERE id IN (
       SELECT id FROM runs WHERE job_id = $1 ORDER BY scheduled_for DESC OFFSET 5 LIMIT 1)`,
    [id],
  );
  // 10 old runs; keep newest 3; of the other 7: 3 have an open dead letter, 1 is queued: 3 go.
  assert.equal(await pruner().sweepRuns(), 3);
  assert.equal((await runsOfJob(id)).n, 7);
});

test('published outbox rows past their retention are deleted however many there are; pending ones stay', async () => {
  await publishedOutboxRows('k', 25_000);
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload, published_at) VALUES ('t', 'recent', '{}', now()), ('t', 'pending', '{}', NULL)`,
  );
  assert.equal(await pruner().pruneOutbox(), 25_000, 'more than one batch in one pass');
  const { rows } = await db.pool.query<{ key: string }>(`SELECT key FROM outbox ORDER BY key`);
  assert.deepEqual(
    rows.map((r) => r.key),
    ['pending', 'recent'],
  );
});

test("a job whose runs cannot be pruned keeps neither the other jobs' history nor the sweeps from being pruned", async (t) => {
  const stuck = await job('stuck');
  await history(stuck, 10, 100);
  const others = [await job('other-1'), await job('other-2'), await job('other-3')];
  for (const id of others) await history(id, 10, 100);
  // PostgreSQL refuses to delete the stuck job's runs (as a statement timeout or a lock would).
  await db.pool.query(`
    CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION 'refused: %', TG_TABLE_NAME; END $$`);
  await db.pool.query(
    `CREATE TRIGGER refuse_stuck BEFORE DELETE ON runs FOR EACH ROW
     WHEN (OLD.job_id = '${stuck}') EXECUTE FUNCTION refuse_delete()`,
  );
  t.after(() =>
    db.pool.query('DROP TRIGGER IF EXISTS refuse_stuck ON runs; DROP FUNCTION refuse_delete CASCADE'),
  );

  assert.equal(
    await pruner().sweepRuns(),
    3 * 7,
    "every other job's runs past the retention, all but 3 each",
  );
  assert.equal((await runsOfJob(stuck)).n, 10, 'the stuck job is left for the next sweep');
  for (const id of others) assert.equal((await runsOfJob(id)).n, 3);

  // The leader's loop: an outbox prune that fails does not keep the runs from being swept.
  const more = await job('more');
  await history(more, 10, 100);
  await db.pool.query(
    `CREATE TRIGGER refuse_outbox BEFORE DELETE ON outbox FOR EACH ROW EXECUTE FUNCTION refuse_delete()`,
  );
  t.after(() => db.pool.query('DROP TRIGGER IF EXISTS refuse_outbox ON outbox'));
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload, published_at) VALUES ('t', 'old', '{}', now() - interval '1 hour')`,
  );
  const stop = new AbortController();
  const metrics = createMetrics('retention-loop-test');
  const loop = pruner({ signal: stop.signal, intervalMs: 50, runSweepMs: 50, metrics }).run();
  const deadline = Date.now() + 10_000;
  // Until the job is swept and a whole sweep has been counted (one stopped halfway is not).
  const swept = async () =>
    (await runsOfJob(more)).n === 3 && ((await passCounts(metrics))['runs incomplete'] ?? 0) >= 1;
  while (!(await swept()) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
  stop.abort();
  await loop;
  assert.equal((await runsOfJob(more)).n, 3, 'swept while the outbox prune kept failing');
  // Every pass counted by its result: the outbox's all failed, the runs' left the stuck job.
  const passes = await passCounts(metrics);
  assert.ok(passes['outbox failed']! >= 1, JSON.stringify(passes));
  assert.ok(passes['runs incomplete']! >= 1, JSON.stringify(passes));
  assert.equal(passes['outbox succeeded'], 0, JSON.stringify(passes));
  assert.equal(passes['runs failed'], 0, JSON.stringify(passes));
});

test('a batch PostgreSQL refused does not hide the runs it had locked from the smaller batches tried next', async (t) => {
  // PostgreSQL answers an error before its transaction has ended and released its row locks, and
  // the pool discards the connection that failed: a smaller batch tried at once on another
  // connection would find the runs the refused batch had locked still locked, and skip them. The
  // race is short (connections kept warm make the retry as quick as it gets), so every sweep here
  // is refused many times: several jobs refuse, in several rounds.
  const pool = new pg.Pool({ connectionString: db.url, max: 8, application_name: 'retention-locks' });
  t.after(async () => {
    // pool.end() resolves before its sessions have ended; one the database's drop ended would throw.
    await pool.end();
    const open = `SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = 'retention-locks'`;
    while ((await db.pool.query<{ n: number }>(open)).rows[0]!.n > 0)
      await new Promise((r) => setTimeout(r, 10));
  });
  const refusing = await Promise.all(Array.from({ length: 4 }, (_, i) => job(`refusing-${i}`)));
  const others = await Promise.all(Array.from({ length: 4 }, (_, i) => job(`pruned-${i}`)));
  for (const id of refusing) await history(id, 10, 100);
  await db.pool.query(`
    CREATE FUNCTION refuse_some() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION 'refused'; END $$`);
  await db.pool.query(
    `CREATE TRIGGER refuse_some BEFORE DELETE ON runs FOR EACH ROW
     WHEN (OLD.job_id IN (${refusing.map((id) => `'${id}'`).join(', ')})) EXECUTE FUNCTION refuse_some()`,
  );
  t.after(() => db.pool.query('DROP FUNCTION refuse_some CASCADE'));
  const metrics = createMetrics('retention-locks-test');
  const sweeper = pruner({ pool, metrics });
  for (let round = 0; round < 5; round += 1) {
    for (const id of others) await history(id, 10, 100 + 20 * round);
    await Promise.all(Array.from({ length: 8 }, () => pool.query('SELECT pg_sleep(0.02)')));
    await sweeper.sweepRuns();
    const left = await Promise.all(others.map(async (id) => (await runsOfJob(id)).n));
    assert.deepEqual(left, [3, 3, 3, 3], `round ${round}: every other job's runs past the retention went`);
  }
  for (const id of refusing) assert.equal((await runsOfJob(id)).n, 10);
  // Every sweep tried the refusing jobs and counted itself incomplete; none passed them by unseen.
  const passes = await passCounts(metrics);
  assert.deepEqual([passes['runs incomplete'], passes['runs succeeded']], [5, 0], JSON.stringify(passes));
});

test('passes that cannot reach PostgreSQL are counted as failed', async (t) => {
  // A pool to a port where nothing listens: each connection is refused.
  const unreachable = new pg.Pool({ connectionString: 'postgres://helios@127.0.0.1:1/none', max: 1 });
  t.after(() => unreachable.end());
  const metrics = createMetrics('retention-outage-test');
  const refused = pruner({ pool: unreachable, metrics });
  await assert.rejects(refused.pruneOutbox(), /ECONNREFUSED/);
  await assert.rejects(refused.sweepRuns(), /ECONNREFUSED/);
  assert.deepEqual(await passCounts(metrics), {
    'outbox succeeded': 0,
    'outbox failed': 1,
    'runs succeeded': 0,
    'runs incomplete': 0,
    'runs failed': 1,
  });
});

test('a long sweep of runs keeps pruning the outbox meanwhile', async (t) => {
  // A sweep prunes a job with more than a batch of runs again before it moves on, so the first
  // sweeps after the retention was shortened run long; the outbox passes the loop makes between
  // sweeps waited for it, and the outbox grew by every run dispatched meanwhile. Here each delete of
  // runs takes 200 ms (a statement trigger), the sweep three batches of one job.
  const id = await job('long-sweep');
  await finishedManualRuns(id, 1200);
  await publishedOutboxRows('old', 100);
  await db.pool.query(`CREATE FUNCTION slow_prune() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN PERFORM pg_sleep(0.2); RETURN NULL; END $$;
    CREATE TRIGGER slow_prune AFTER DELETE ON runs FOR EACH STATEMENT EXECUTE FUNCTION slow_prune()`);
  t.after(() => db.pool.query('DROP TRIGGER slow_prune ON runs; DROP FUNCTION slow_prune()'));
  const sweeper = pruner({ intervalMs: 100 });
  await sweeper.sweepRuns();
  assert.equal((await runsOfJob(id)).n, 3, 'the sweep pruned the job to its newest 3');
  const { rows } = await db.pool.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM outbox WHERE key = 'old'`,
  );
  assert.equal(rows[0]!.n, 0, 'published outbox rows past their retention left while the sweep ran');
});

test('a sweep prunes a busy job down to its newest N, so a job making runs faster than a batch a minute stays bounded', async () => {
  // Last in the file: the fourth test counts every run its sweep prunes, and the first test left one
  // that falls past the retention a second after it was made; this test's sweeps take about that long.
  // Manual triggers (or a catch-up, or a shortened retention) can give one job more finished runs
  // between two sweeps (a minute) than one statement prunes per job: the sweep used to leave the
  // rest to the next sweeps, so a job triggered 10 times a second grew by 100 runs a minute for ever.
  // Several of each: a busy job first of all jobs (the sweep starts again from the start), the last,
  // and one among the others.
  const busy = [await job('triggered-1'), await job('triggered-2'), await job('triggered-3')];
  for (const [i, id] of [
    '00000000-0000-4000-8000-000000000000',
    'ffffffff-ffff-4fff-bfff-ffffffffffff',
  ].entries()) {
    await db.pool.query(`UPDATE jobs SET id = $2 WHERE id = $1`, [busy[i], id]);
    busy[i] = id;
  }
  const quiet = [await job('beside-1'), await job('beside-2'), await job('beside-3')];
  const left: number[][] = [];
  for (let round = 0; round < 3; round += 1) {
    for (const id of busy) await finishedManualRuns(id, 1200, { first: round * 1200, stepMs: 100 });
    for (const id of quiet) await history(id, 10, 100 + 20 * round);
    await pruner().sweepRuns();
    left.push(await Promise.all([...busy, ...quiet].map(async (id) => (await runsOfJob(id)).n)));
  }
  assert.deepEqual(
    left,
    [0, 1, 2].map(() => [3, 3, 3, 3, 3, 3]),
    'after each sweep, each job keeps its newest 3',
  );
});

/** helios_prune_passes_total by "table result", as a scrape shows it. */
async function passCounts(metrics: ReturnType<typeof createMetrics>): Promise<Record<string, number>> {
  const scrape = parseMetrics(await metrics.registry.metrics());
  return Object.fromEntries(
    scrape.find('helios_prune_passes_total').map((s) => [`${s.labels.table} ${s.labels.result}`, s.value]),
  );
}

test('a long sweep on a leader pool of one connection prunes the outbox on its own session', async (t) => {
  // HELIOS_LEADER_POOL_SIZE may be 1. The sweep holds its connection for the whole pass, so an
  // outbox pass taken from the pool meanwhile waited for a free connection until the pool's connect
  // timeout (5 s) and failed, and the next batch tried again: every batch of the sweep waited 5 s
  // (a shortened retention's first sweep, hundreds of batches, held the leader's only connection for
  // an hour) and the outbox was not pruned after all. Here a job with 2,000 runs to prune: 4 batches.
  const id = await job('one-connection');
  await finishedManualRuns(id, 2003);
  await publishedOutboxRows('old-one-connection', 100);
  const pool = createPool({
    connectionString: db.url,
    max: 1,
    logger: silentLogger,
    applicationName: 'prune-one',
  });
  t.after(() => pool.end());
  const metrics = createMetrics('retention-test');
  const sweeper = pruner({ pool, intervalMs: 0, metrics });
  const started = performance.now();
  await sweeper.sweepRuns();
  const tookMs = performance.now() - started;
  assert.equal((await runsOfJob(id)).n, 3, 'the sweep pruned the job to its newest 3');
  const { rows } = await db.pool.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM outbox WHERE key = 'old-one-connection'`,
  );
  assert.equal(rows[0]!.n, 0, 'published outbox rows past their retention left while the sweep ran');
  assert.equal((await passCounts(metrics))['outbox failed'], 0, 'no outbox pass failed');
  assert.ok(tookMs < 4000, `the sweep took ${Math.round(tookMs)} ms`);
});

test('a job whose runs cannot be pruned is tried once a sweep, not again for every batch of a full job before it', async (t) => {
  // A batch PostgreSQL refuses is tried on fewer jobs, down to one. A full job is pruned again
  // before the sweep moves on, and the batch size doubled after each of its batches: so the batch
  // after each 500 runs of the full job took in the refused job again, and was refused again (each
  // refusal a statement timeout, 30 s, when that is why). Here the full job has 5,000 runs to prune.
  const full = '00000000-0000-4000-8000-000000000001';
  const refused = '00000000-0000-4000-8000-000000000002';
  for (const [name, id] of [
    ['full-before-refused', full],
    ['refused-after-full', refused],
  ]) {
    await db.pool.query(`UPDATE jobs SET id = $2 WHERE id = $1`, [await job(name!), id]);
  }
  await finishedManualRuns(full, 5003);
  await history(refused, 10, 100);
  // The refusals are counted by a sequence, which a rolled-back statement does not take back.
  await db.pool.query(`
    CREATE SEQUENCE prune_refusals;
    CREATE FUNCTION refuse_counted() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN PERFORM nextval('prune_refusals'); RAISE EXCEPTION 'refused'; END $$;
    CREATE TRIGGER refuse_counted BEFORE DELETE ON runs FOR EACH ROW
    WHEN (OLD.job_id = '${refused}') EXECUTE FUNCTION refuse_counted()`);
  t.after(() =>
    db.pool.query(
      'DROP TRIGGER refuse_counted ON runs; DROP FUNCTION refuse_counted(); DROP SEQUENCE prune_refusals',
    ),
  );
  await pruner().sweepRuns();
  assert.equal((await runsOfJob(full)).n, 3, 'the full job was pruned to its newest 3');
  const { rows } = await db.pool.query<{ n: string }>(`SELECT last_value AS n FROM prune_refusals`);
  // Halving from 200 jobs to 1 meets it 8 times, and once the full job is done, twice more.
  assert.ok(Number(rows[0]!.n) <= 10, `the refused job was tried ${rows[0]!.n} times`);
});
