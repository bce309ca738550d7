import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type pg from 'pg';
import { pruneOutbox, pruneRuns } from '../../src/store/retention.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { capturedStatement, holdStatistics, loopsOfScan } from '../support/plans.js';

// The pruner's statements on statistics taken while a table had been drained: a few live rows in
// many pages, as the outbox is between herds once the pruner has emptied it (and VACUUM or ANALYZE
// ran then). Written as "id IN (subquery)", the planner took the table for one row and ran the
// subquery again for each row it scanned: the outbox's prune took 4 s for 5,000 rows and passed
// the 30 s statement timeout at 20,000 (helper-41, 2026-12-06). As arrays they scan once.

const ROWS = 3000;
const JOBS = 100;
const RUNS_PER_JOB = 30;

let db: TestDatabase;

before(async () => {
  db = await createTestDatabase();
  await holdStatistics(db.pool, 'outbox', 'runs');
  await db.pool.query(
    `INSERT INTO jobs (name, schedule, target, next_run_at)
     SELECT 'drained-' || n, '0 0 0 * * *', '{"url": "http://127.0.0.1:9/"}', NULL FROM generate_series(1, $1::int) AS n`,
    [JOBS],
  );
  // Drained: rows that filled the pages are gone, one live row at the end keeps the pages (VACUUM
  // truncates only empty pages at the end), and the statistics count that one row.
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload) SELECT 'drained', 'k', '{}' FROM generate_series(1, $1::int)`,
    [ROWS + 1],
  );
  await db.pool.query(`DELETE FROM outbox WHERE id < (SELECT max(id) FROM outbox)`);
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before)
     SELECT j.id, now() + g * interval '1 second', 'queued', 3, j.target, 5000, 1000, 2, now()
     FROM jobs j, generate_series(1, $1::int) AS g`,
    [ROWS / JOBS + 1],
  );
  await db.pool.query(`DELETE FROM runs WHERE id <> (SELECT id FROM runs ORDER BY ctid DESC LIMIT 1)`);
  await db.pool.query('VACUUM ANALYZE outbox');
  await db.pool.query('VACUUM ANALYZE runs');
  // (The run that kept the pages goes too, unseen by the statistics: its job's newest runs are the
  // finished ones below, as for every other job.)
  await db.pool.query('DELETE FROM runs');
  // Then they filled again: published rows and finished runs, all past their retention.
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload, published_at)
     SELECT 'drained', 'k', '{}', now() - interval '1 day' FROM generate_series(1, $1::int)`,
    [ROWS],
  );
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before, finished_at)
     SELECT j.id, now() - interval '40 days' - g * interval '1 minute', 'succeeded', 1, 3, j.target, 5000,
            1000, 2, now() - interval '40 days', now() - interval '40 days'
     FROM jobs j, generate_series(1, $1::int) AS g`,
    [RUNS_PER_JOB],
  );
});
after(() => db.drop());

/** What `work` returns in a transaction that is then rolled back (the rows stay for the next test). */
async function rolledBack<T>(work: (client: pg.PoolClient) => Promise<T>): Promise<T> {
  const client = await db.pool.connect();
  try {
    await client.query('BEGIN');
    return await work(client);
  } finally {
    await client.query('ROLLBACK');
    client.release();
  }
}

const OUTBOX_RETENTION_MS = 600_000;
const outboxStatement = () => capturedStatement((c) => pruneOutbox(c, OUTBOX_RETENTION_MS, 10_000));
const runsOptions = async () => ({
  cutoff: new Date(Date.now() - 30 * 86_400_000),
  keepPerJob: 2,
  afterJob: null,
  jobs: 200,
  perJob: 500,
});
const runsStatement = async () => {
  const options = await runsOptions();
  return capturedStatement((c) => pruneRuns(c, options));
};

test('the statistics count one live row in each table', async () => {
  const { rows } = await db.pool.query<{ relname: string; reltuples: number; relpages: number }>(
    `SELECT relname, reltuples, relpages FROM pg_class WHERE relname IN ('outbox', 'runs') ORDER BY relname`,
  );
  assert.deepEqual(
    rows.map((r) => [r.relname, r.reltuples]),
    [
      ['outbox', 1],
      ['runs', 1],
    ],
  );
  assert.ok(
    rows.every((r) => r.relpages > 10),
    JSON.stringify(rows),
  );
});

test("the outbox's prune reads the old rows once, whatever the statistics, and deletes them", async () => {
  const { sql, params } = await outboxStatement();
  assert.deepEqual(await loopsOfScan(db.pool, sql, params, 'outbox_1'), [1]);
  assert.equal(await rolledBack((c) => pruneOutbox(c, OUTBOX_RETENTION_MS, 10_000)), ROWS);
});

test("the runs' prune reads its doomed runs once, whatever the statistics, and deletes them", async () => {
  const { sql, params } = await runsStatement();
  assert.deepEqual(await loopsOfScan(db.pool, sql, params, 'doomed'), [1]);
  const options = await runsOptions();
  const { pruned } = await rolledBack((c) => pruneRuns(c, options));
  assert.equal(pruned, JOBS * (RUNS_PER_JOB - 2));
});

test('written as "id IN (subquery)", as before, both scan their subquery once per row of the table', async () => {
  // The control: the form these statements had until 2026-12-06, on the same statistics. If the
  // planner stopped choosing the nested loop here, the tests above would show nothing.
  const outbox = await outboxStatement();
  const outboxBefore = outbox.sql.replace('id = ANY (ARRAY(', 'id IN (').replace('LIMIT $2))', 'LIMIT $2)');
  assert.notEqual(
    outboxBefore,
    outbox.sql,
    'the outbox statement no longer has the form this control rewrites',
  );
  const outboxLoops = await loopsOfScan(db.pool, outboxBefore, outbox.params, 'outbox_1');
  assert.ok(
    outboxLoops.some((n) => n >= ROWS),
    `the outbox's subquery ran ${outboxLoops.join(', ')} times`,
  );

  const runs = await runsStatement();
  const runsBefore = runs.sql.replace(
    'id = ANY (ARRAY(SELECT id FROM doomed))',
    'id IN (SELECT id FROM doomed)',
  );
  assert.notEqual(runsBefore, runs.sql, 'the runs statement no longer has the form this control rewrites');
  const runsLoops = await loopsOfScan(db.pool, runsBefore, runs.params, 'doomed');
  assert.ok(
    runsLoops.some((n) => n >= ROWS),
    `the doomed runs were scanned ${runsLoops.join(', ')} times`,
  );
});
