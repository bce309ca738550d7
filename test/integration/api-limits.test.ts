import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Registry } from 'prom-client';
import { buildApiServer } from '../../src/api/server.js';
import { MAX_PAGE_BYTES } from '../../src/api/cursor.js';
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
