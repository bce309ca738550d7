import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import pg from 'pg';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// An API whose PostgreSQL is there but does not answer in time (a session holds the tables), or
// is not there at all, answers 503 problem+json with Retry-After, never a 500, and writes nothing.

let db: TestDatabase;
/** The API's own pool: statements cancelled after 300 ms (the node's pool: 30 s). */
let slowPool: pg.Pool;
let api: TestApi;

before(async () => {
  db = await createTestDatabase();
  slowPool = new pg.Pool({ connectionString: db.url, max: 4, statement_timeout: 300 });
  api = await startTestApi({ db: { ...db, pool: slowPool } });
});
after(async () => {
  await api.close();
  await slowPool.end();
  await db.drop();
});

/** Runs `body` while another session holds every table the API reads and writes. */
async function whileTablesHeld<T>(body: () => Promise<T>): Promise<T> {
  const holder = await db.pool.connect();
  try {
    await holder.query('BEGIN');
    await holder.query('LOCK TABLE jobs, runs, outbox IN ACCESS EXCLUSIVE MODE');
    return await body();
  } finally {
    await holder.query('ROLLBACK');
    holder.release();
  }
}

function assertUnavailable(response: { status: number; headers: Headers; body: unknown }, what: string) {
  assert.equal(response.status, 503, `${what}: ${JSON.stringify(response.body)}`);
  assert.equal(response.headers.get('content-type'), 'application/problem+json; charset=utf-8', what);
  assert.equal(response.headers.get('retry-after'), '2', what);
  assert.equal((response.body as { type: string }).type, 'urn:helios:problem:database-unavailable', what);
}

test('requests that PostgreSQL does not answer within the statement timeout are a 503 and write nothing', async () => {
  const created = await api.call('POST', '/api/v1/jobs', {
    body: jobBody('held', { schedule: '0 0 1 1 *' }),
  });
  assert.equal(created.status, 201, created.text);
  const { id } = created.body as { id: string };
  const paused = await api.call('POST', `/api/v1/jobs/${id}/pause`);
  assert.equal(paused.status, 200, paused.text);
  const before = await db.pool.query('SELECT * FROM jobs ORDER BY id');

  await whileTablesHeld(async () => {
    assertUnavailable(await api.call('GET', '/api/v1/jobs'), 'list');
    assertUnavailable(await api.call('GET', `/api/v1/jobs/${id}`), 'read');
    assertUnavailable(await api.call('POST', `/api/v1/jobs/${id}/resume`), 'resume');
    assertUnavailable(await api.call('POST', `/api/v1/jobs/${id}/trigger`), 'trigger');
    assertUnavailable(
      await api.call('POST', '/api/v1/jobs', { body: jobBody('while-held', { schedule: '0 0 1 1 *' }) }),
      'create',
    );
  });
  assert.deepEqual(
    (await db.pool.query('SELECT * FROM jobs ORDER BY id')).rows,
    before.rows,
    'nothing written',
  );
  assert.equal((await db.pool.query('SELECT count(*)::int AS n FROM runs')).rows[0].n, 0);
  // Released, the same requests go through.
  assert.equal((await api.call('POST', `/api/v1/jobs/${id}/resume`)).status, 200);
});

test('an API whose PostgreSQL cannot be reached answers 503, not 500', async () => {
  // A port nothing listens on (the pool's connection is refused).
  const unreachable = new pg.Pool({ connectionString: 'postgres://helios@127.0.0.1:1/helios', max: 1 });
  const down = await startTestApi({ db: { ...db, pool: unreachable, drop: async () => undefined } });
  try {
    assertUnavailable(await down.call('GET', '/api/v1/jobs'), 'list');
    assertUnavailable(
      await down.call('POST', '/api/v1/jobs', { body: jobBody('unreached', { schedule: '0 0 1 1 *' }) }),
      'create',
    );
  } finally {
    await down.close();
    await unreachable.end();
  }
});
