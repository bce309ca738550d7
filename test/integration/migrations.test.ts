import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { loadMigrations, migrate, type Migration } from '../../src/store/migrate.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { REPO_ROOT, serverEnv } from '../support/env.js';
import { runCli } from '../support/processes.js';

let db: TestDatabase;
before(async () => {
  db = await createTestDatabase({ empty: true });
});
after(async () => {
  await db?.drop();
});

/** Runs `helios migrate` (the built CLI) against the test database. */
function runMigrateCli() {
  return runCli(['migrate'], {
    PATH: process.env.PATH,
    HELIOS_DATABASE_URL: db.url,
    HELIOS_ETCD_ENDPOINTS: serverEnv().etcdEndpoints,
    HELIOS_KAFKA_BROKERS: serverEnv().kafkaBrokers,
  });
}

test('two processes migrating an empty database at once end in one schema', async () => {
  const [a, b] = await Promise.all([runMigrateCli(), runMigrateCli()]);
  assert.equal(a.code, 0, a.output);
  assert.equal(b.code, 0, b.output);
  const expected = (await loadMigrations(`${REPO_ROOT}src/store/migrations`)).map((m) => m.version);
  const { rows } = await db.pool.query<{ version: number }>(
    'SELECT version FROM schema_migrations ORDER BY 1',
  );
  assert.deepEqual(
    rows.map((r) => r.version),
    expected,
  );
  // Exactly one of the two applied the migrations; the other found the schema up to date.
  const appliedBy = [a, b].filter((r) => r.output.includes('migrations applied'));
  assert.equal(appliedBy.length, 1, `${a.output}\n---\n${b.output}`);

  const tables = await db.pool.query<{ table_name: string }>(
    `SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1`,
  );
  for (const table of ['dead_letters', 'jobs', 'leader_fence', 'outbox', 'run_attempts', 'runs']) {
    assert.ok(
      tables.rows.some((r) => r.table_name === table),
      `missing table ${table}`,
    );
  }
});

test('migrating again changes nothing', async () => {
  const before = await db.pool.query('SELECT version, applied_at FROM schema_migrations ORDER BY 1');
  const run = await runMigrateCli();
  assert.equal(run.code, 0, run.output);
  assert.match(run.output, /schema is up to date/);
  const afterRun = await db.pool.query('SELECT version, applied_at FROM schema_migrations ORDER BY 1');
  assert.deepEqual(afterRun.rows, before.rows);
});

test('runs are unique per (job, scheduled_for) and the fence row exists', async () => {
  const { rows } = await db.pool.query<{ token: string }>('SELECT token FROM leader_fence');
  assert.deepEqual(rows, [{ token: '0' }]);
  const job = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target) VALUES ('j', '* * * * *', '{"url":"http://x"}') RETURNING id`,
  );
  const insertRun = `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
      backoff_multiplier, not_before) VALUES ($1, '2026-01-01T00:00:00Z', 'queued', 1, '{}', 1000, 0, 1, now())`;
  await db.pool.query(insertRun, [job.rows[0]!.id]);
  await assert.rejects(db.pool.query(insertRun, [job.rows[0]!.id]), /runs_one_per_occurrence/);
});

test('every foreign key has an index led by its columns, without a predicate, for its cascades', async () => {
  // A delete of a referenced row (the pruner's runs, a job) looks up the referencing rows by these
  // columns; without such an index each one scans the whole table. dead_letters.run_id had only a
  // partial index: the pruner's statements grew with the dead letters until they timed out.
  const { rows } = await db.pool.query<{ constraint: string; indexed: boolean }>(
    `SELECT c.conrelid::regclass || '.' || c.conname AS constraint,
            EXISTS (
              SELECT 1 FROM pg_index i
              WHERE i.indrelid = c.conrelid AND i.indpred IS NULL
                AND (i.indkey::int2[])[0:cardinality(c.conkey) - 1] = c.conkey
            ) AS indexed
     FROM pg_constraint c
     JOIN pg_namespace n ON n.oid = c.connamespace
     WHERE c.contype = 'f' AND n.nspname = current_schema()
     ORDER BY 1`,
  );
  assert.ok(rows.length >= 4, `foreign keys found: ${rows.map((r) => r.constraint).join(', ')}`);
  assert.deepEqual(
    rows.filter((r) => !r.indexed).map((r) => r.constraint),
    [],
    'foreign keys without an index led by their columns',
  );
});

test("a migration that cannot have its table's lock gives up within lock_timeout and tries again, so the table's other users do not queue behind it", async () => {
  const scratch = await createTestDatabase();
  try {
    const pending: Migration = {
      version: 900,
      name: 'alter_jobs',
      sql: 'ALTER TABLE jobs ADD COLUMN probe int',
    };
    // A long transaction holds the jobs table (as a slow report would).
    const holder = await scratch.pool.connect();
    await holder.query('BEGIN');
    await holder.query('SELECT count(*) FROM jobs');
    const started = performance.now();
    const migrating = migrate(scratch.pool, [pending], { lockTimeoutMs: 300, tries: 3 });
    // Meanwhile a reader of jobs (a claim, the dispatcher) is not held behind the waiting ALTER for
    // longer than the lock timeout.
    await new Promise((r) => setTimeout(r, 100));
    const read = performance.now();
    await scratch.pool.query('SELECT count(*) FROM jobs');
    const readMs = performance.now() - read;
    await assert.rejects(migrating, (err: { code?: string }) => err.code === '55P03');
    const tookMs = performance.now() - started;
    assert.ok(readMs < 1000, `a reader waited ${readMs.toFixed(0)} ms behind the migration`);
    assert.ok(tookMs >= 3 * 300 + 1000 + 2000 - 100, `gave up after ${tookMs.toFixed(0)} ms: three tries`);
    // Once the table is free, it goes through.
    await holder.query('COMMIT');
    holder.release();
    assert.deepEqual(await migrate(scratch.pool, [pending], { lockTimeoutMs: 300 }), [900]);
  } finally {
    await scratch.drop();
  }
});
