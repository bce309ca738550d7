import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type { ApiRole } from '../../src/config/index.js';
import { ADMIN, jobBody, startTestApi, VIEWER, type TestApi } from '../support/api.js';

// The per-token rate limit of /api/v1 on a real API server and database.

const MAX = 5;
let api: TestApi;
before(async () => {
  api = await startTestApi({
    tokens: new Map<string, ApiRole>([
      [ADMIN, 'admin'],
      [VIEWER, 'viewer'],
    ]),
    rateLimit: { max: MAX, windowMs: 60_000 },
  });
});
after(() => api.close());

const jobCount = async () =>
  (await api.db.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM jobs')).rows[0]!.n;

test('a burst beyond the limit gets 429 problems with Retry-After and stores nothing more', async () => {
  const answers = [];
  for (let i = 0; i < MAX + 3; i++) {
    answers.push(await api.call('POST', '/api/v1/jobs', { token: ADMIN, body: jobBody(`burst-${i}`) }));
  }
  assert.deepEqual(
    answers.map((a) => a.status),
    [...Array<number>(MAX).fill(201), 429, 429, 429],
  );
  const limited = answers.at(-1)!;
  assert.match(limited.headers.get('content-type') ?? '', /application\/problem\+json/);
  assert.equal((limited.body as { status: number }).status, 429);
  assert.ok(Number(limited.headers.get('retry-after')) > 0, 'Retry-After says when to come back');
  assert.equal(await jobCount(), MAX, 'the refused requests stored nothing');

  // The budget is per token: another token still has its own.
  assert.equal((await api.call('GET', '/api/v1/jobs', { token: VIEWER })).status, 200);
});

test('requests without a valid token count against their address, whatever token they guess', async () => {
  const statuses = [];
  for (let i = 0; i < MAX + 2; i++) {
    statuses.push((await api.call('GET', '/api/v1/jobs', { token: `guess-${i}-0123456789abcdef` })).status);
  }
  assert.deepEqual(statuses, [...Array<number>(MAX).fill(401), 429, 429]);
});
