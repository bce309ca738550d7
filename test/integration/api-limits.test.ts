import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Registry } from 'prom-client';
import { buildApiServer } from '../../src/api/server.js';
import { MAX_PAGE_BYTES } from '../../src/api/cursor.js';
import { JOB_PAGE_CHUNK } from '../../src/api/routes/jobs.js';
import { DELETE_HISTORY_BATCH } from '../../src/jobs/commands.js';
import { createLogger } from '../../src/observability/logger.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';

// Limits that keep one caller from costing a node (or its servers) without bound.

let api: TestApi;
before(async () => {
  api = await startTestApi();
});
after(() => api.close());

/** GET /jobs page after page, following the cursors: each page's text and items. */
async function* jobPages(limit: number): AsyncGenerator<{ text: string; items: { name: string }[] }> {
  let cursor: string | null = null;
  do {
    const page = await api.call(
      'GET',
      `/api/v1/jobs?limit=${limit}${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`,
    );
    assert.equal(page.status, 200);
    const body = page.body as { items: { name: string }[]; nextCursor: string | null };
    yield { text: page.text, items: body.items };
    cursor = body.nextCursor;
  } while (cursor);
}

test('GET /jobs is bounded by bytes as well as by count, and its cursor still reaches every job', async () => {
  // 20 jobs of ~60 KiB each: 1.2 MiB, more than one page may hold.
  const big = 'x'.repeat(60 * 1024);
  for (let i = 0; i < 20; i++) {
    const created = await api.call('POST', '/api/v1/jobs', {
      body: jobBody(`big-${i}`, { target: { url: 'http://127.0.0.1:9/', body: { big } } }),
    });
    assert.equal(created.status, 201);
  }
  const names = new Set<string>();
  let pages = 0;
  for await (const page of jobPages(100)) {
    assert.ok(Buffer.byteLength(page.text) <= MAX_PAGE_BYTES + 2048, `a page of ${page.text.length} bytes`);
    for (const item of page.items) names.add(item.name);
    pages += 1;
    if (pages === 10) break;
  }
  assert.ok(pages >= 2, 'the byte bound cut the list into pages');
  assert.equal(names.size, 20, 'every job is reached through the cursors');
});

test('GET /jobs reads large jobs from PostgreSQL in chunks and stops once the page is full', async () => {
  // 100 jobs of ~20 KiB (besides the 20 above): a page of limit 500 holds about 50 of them. Read
  // all at once, the node would hold every one of the 120 (up to 501 of up to 256 KiB each).
  const body = { big: 'y'.repeat(20 * 1024) };
  for (let i = 0; i < 100; i++) {
    const created = await api.call('POST', '/api/v1/jobs', {
      body: jobBody(`chunk-${i}`, { target: { url: 'http://127.0.0.1:9/', body } }),
    });
    assert.equal(created.status, 201);
  }
  const pool = api.db.pool;
  const query = pool.query.bind(pool) as (...args: unknown[]) => Promise<{ rowCount: number | null }>;
  let rowsRead = 0;
  pool.query = (async (...args: unknown[]) => {
    const result = await query(...args);
    if (typeof args[0] === 'string' && /FROM jobs\s+WHERE \$1::timestamptz IS NULL/.test(args[0])) {
      rowsRead += result.rowCount ?? 0;
    }
    return result;
  }) as typeof pool.query;
  try {
    const names: string[] = [];
    let firstPage = 0;
    let firstRead = 0;
    for await (const page of jobPages(500)) {
      names.push(...page.items.map((item) => item.name));
      if (firstPage === 0) [firstPage, firstRead] = [page.items.length, rowsRead];
      if (names.length >= 1000) break;
    }
    assert.ok(firstPage < 120, `the first page holds ${firstPage} jobs`);
    assert.ok(
      firstRead <= firstPage + JOB_PAGE_CHUNK,
      `the first page of ${firstPage} jobs read ${firstRead} rows (chunks of ${JOB_PAGE_CHUNK})`,
    );
    assert.equal(names.length, 120);
    assert.equal(new Set(names).size, 120, 'every job once, through the cursors');
  } finally {
    pool.query = query as typeof pool.query;
  }
});

test('DELETE /jobs removes a long history in statements of a bounded size, then the job and the rest', async () => {
  const ids: string[] = [];
  for (const name of ['long-history', 'kept-history']) {
    const created = await api.call('POST', '/api/v1/jobs', { body: jobBody(name, { enabled: false }) });
    assert.equal(created.status, 201);
    ids.push((created.body as { id: string }).id);
  }
  const [doomed, kept] = ids as [string, string];
  const history = DELETE_HISTORY_BATCH * 2 + 500;
  const db = api.db.pool;
  // Finished runs with an attempt each, one dead run with an open dead letter and one queued run;
  // the other job gets a few finished runs of its own.
  await db.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before, finished_at)
     SELECT j.id, now() - s * interval '1 second', CASE WHEN s = 1 THEN 'dead' ELSE 'succeeded' END, 1, 1,
            j.target, 1000, 0, 1, now() - s * interval '1 second', now()
     FROM jobs j, generate_series(1, CASE WHEN j.id = $1 THEN $2::int ELSE 50 END) s WHERE j.id IN ($1, $3)`,
    [doomed, history, kept],
  );
  await db.query(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before)
     SELECT id, now() + interval '1 hour', 'queued', 1, target, 1000, 0, 1, now() + interval '1 hour'
     FROM jobs WHERE id = $1`,
    [doomed],
  );
  await db.query(
    `INSERT INTO run_attempts (run_id, attempt, node_id, finished_at, outcome)
     SELECT id, 1, 'n1', now(), 'succeeded' FROM runs WHERE state <> 'queued'`,
  );
  await db.query(
    `INSERT INTO dead_letters (run_id, job_id, attempt) SELECT id, job_id, 1 FROM runs WHERE state = 'dead'`,
  );
  // Counts the runs each statement deleted, cascades included (a cascade is one statement).
  await db.query(`CREATE TABLE deleted_runs_per_statement (n int)`);
  await db.query(`CREATE FUNCTION count_deleted_runs() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN INSERT INTO deleted_runs_per_statement SELECT count(*) FROM gone; RETURN NULL; END $$`);
  await db.query(`CREATE TRIGGER count_deleted_runs AFTER DELETE ON runs REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION count_deleted_runs()`);
  try {
    const deleted = await api.call('DELETE', `/api/v1/jobs/${doomed}`);
    assert.equal(deleted.status, 204);
    const { rows } = await db.query<{ n: number }>(`SELECT n FROM deleted_runs_per_statement WHERE n > 0`);
    const perStatement = rows.map((r) => r.n);
    assert.equal(
      perStatement.reduce((a, b) => a + b, 0),
      history + 1,
      'every run of the job was deleted, once',
    );
    assert.ok(
      perStatement.every((n) => n <= DELETE_HISTORY_BATCH),
      `runs deleted per statement: ${perStatement.join(', ')}`,
    );
    const left = await db.query<{ runs: number; letters: number; job: number }>(
      `SELECT (SELECT count(*) FROM runs WHERE job_id = $1)::int AS runs,
              (SELECT count(*) FROM dead_letters WHERE job_id = $1)::int AS letters,
              (SELECT count(*) FROM jobs WHERE id = $1)::int AS job`,
      [doomed],
    );
    assert.deepEqual(left.rows[0], { runs: 0, letters: 0, job: 0 });
    const other = await db.query<{ n: number }>(`SELECT count(*)::int AS n FROM runs WHERE job_id = $1`, [
      kept,
    ]);
    assert.equal(other.rows[0]!.n, 50, "the other job's history stays");
    assert.equal((await api.call('DELETE', `/api/v1/jobs/${doomed}`)).status, 404);
  } finally {
    await db.query(`DROP TRIGGER count_deleted_runs ON runs`);
    await db.query(`DROP FUNCTION count_deleted_runs(); DROP TABLE deleted_runs_per_statement`);
  }
});

test('/readyz makes at most one round trip per server per second, whatever the request rate', async () => {
  let calls = 0;
  const app = await buildApiServer({
    logger: createLogger({ level: 'silent', nodeId: 'readyz' }),
    metrics: new Registry(),
    probes: {
      postgres: async () => {
        calls += 1;
        await api.db.pool.query('SELECT 1');
      },
    },
  });
  try {
    const started = Date.now();
    const statuses: number[] = [];
    while (Date.now() - started < 1500) {
      const burst = await Promise.all(
        Array.from({ length: 20 }, () => app.inject({ method: 'GET', url: '/readyz' })),
      );
      statuses.push(...burst.map((r) => r.statusCode));
    }
    assert.ok(statuses.length >= 100);
    assert.ok(statuses.every((s) => s === 200));
    assert.ok(calls <= 2, `${calls} probe round trips for ${statuses.length} requests in 1.5 s`);
  } finally {
    await app.close();
  }
});
