import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Registry } from 'prom-client';
import { buildApiServer } from '../../src/api/server.js';
import { MAX_PAGE_BYTES } from '../../src/api/cursor.js';
import { JOB_PAGE_CHUNK } from '../../src/api/routes/jobs.js';
import { createLogger } from '../../src/observability/logger.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';

// Limits that keep one caller from costing a node (or its servers) without bound.

let api: TestApi;
before(async () => {
  api = await startTestApi();
});
after(() => api.close());

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
  let cursor: string | null = null;
  let pages = 0;
  do {
    const page = await api.call(
      'GET',
      `/api/v1/jobs?limit=100${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`,
    );
    assert.equal(page.status, 200);
    assert.ok(Buffer.byteLength(page.text) <= MAX_PAGE_BYTES + 2048, `a page of ${page.text.length} bytes`);
    const body = page.body as { items: { name: string }[]; nextCursor: string | null };
    for (const item of body.items) names.add(item.name);
    cursor = body.nextCursor;
    pages += 1;
  } while (cursor && pages < 10);
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
    let cursor: string | null = null;
    let firstPage = 0;
    let firstRead = 0;
    do {
      const page = await api.call(
        'GET',
        `/api/v1/jobs?limit=500${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`,
      );
      assert.equal(page.status, 200);
      const list = page.body as { items: { name: string }[]; nextCursor: string | null };
      names.push(...list.items.map((item) => item.name));
      if (firstPage === 0) [firstPage, firstRead] = [list.items.length, rowsRead];
      cursor = list.nextCursor;
    } while (cursor && names.length < 1000);
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
