import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import pg from 'pg';
import { parseCron } from '../../src/scheduling/cron.js';
import { createManualRun, manualRunInstant } from '../../src/store/manual-run.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';
import { queuedRuns, untilWaitingForLocks } from '../support/execution.js';

let api: TestApi;
before(async () => {
  api = await startTestApi();
});
after(() => api.close());

interface JobResponse {
  id: string;
  name: string;
  nextRunAt: string | null;
  createdAt: string;
  updatedAt: string;
  timezone: string;
  timeoutMs: number;
  enabled: boolean;
  schedule: string;
  target: { url: string; method: string; headers: Record<string, string>; body?: unknown };
  retry: { maxAttempts: number; backoffMs: number; backoffMultiplier: number };
}
interface ProblemResponse {
  type: string;
  title: string;
  status: number;
  errors?: { field: string; message: string }[];
}

async function jobCount(): Promise<number> {
  const { rows } = await api.db.pool.query<{ n: number }>('SELECT count(*)::int AS n FROM jobs');
  return rows[0]!.n;
}

function assertProblem(
  response: { status: number; headers: Headers; body: unknown },
  status: number,
  field?: string,
): ProblemResponse {
  assert.equal(response.status, status, JSON.stringify(response.body));
  assert.match(response.headers.get('content-type') ?? '', /^application\/problem\+json/);
  const problem = response.body as ProblemResponse;
  assert.equal(problem.status, status);
  assert.ok(problem.title);
  if (field) {
    assert.ok(
      problem.errors?.some((e) => e.field === field),
      `expected field ${field} in ${JSON.stringify(problem.errors)}`,
    );
  }
  return problem;
}

test('creating a job answers 201 with id, defaults and nextRunAt from the database clock', async () => {
  const created = await api.call('POST', '/api/v1/jobs', { body: jobBody('create-ok') });
  assert.equal(created.status, 201, JSON.stringify(created.body));
  const job = created.body as JobResponse;
  assert.match(job.id, /^[0-9a-f-]{36}$/);
  assert.equal(created.headers.get('location'), `/api/v1/jobs/${job.id}`);
  assert.equal(job.timezone, 'UTC');
  assert.equal(job.timeoutMs, 30_000);
  assert.deepEqual(job.retry, { maxAttempts: 3, backoffMs: 1000, backoffMultiplier: 2 });
  assert.equal(job.enabled, true);
  assert.deepEqual(job.target, {
    url: 'http://127.0.0.1:9/hook',
    method: 'POST',
    headers: {},
    body: { hello: 'world' },
  });
  const expected = parseCron('*/5 * * * *').next(new Date(job.createdAt));
  assert.equal(job.nextRunAt, expected?.toISOString());
  const { rows } = await api.db.pool.query('SELECT name, next_run_at FROM jobs WHERE id = $1', [job.id]);
  assert.equal(rows[0].name, 'create-ok');
  assert.equal((rows[0].next_run_at as Date).toISOString(), job.nextRunAt);
});

test('a body without method becomes a POST; without body a GET', async () => {
  const withBody = await api.call('POST', '/api/v1/jobs', {
    body: jobBody('method-post', { target: { url: 'http://127.0.0.1:9/', body: [1, 2] } }),
  });
  assert.equal((withBody.body as JobResponse).target.method, 'POST');
  const without = await api.call('POST', '/api/v1/jobs', {
    body: jobBody('method-get', { target: { url: 'http://127.0.0.1:9/' } }),
  });
  assert.equal((without.body as JobResponse).target.method, 'GET');
});

test('a duplicate name is a 409 naming the field, and nothing is written', async () => {
  await api.call('POST', '/api/v1/jobs', { body: jobBody('dup') });
  const before = await jobCount();
  assertProblem(await api.call('POST', '/api/v1/jobs', { body: jobBody('dup') }), 409, 'name');
  assert.equal(await jobCount(), before);
});

test('invalid jobs are 400 problems naming the failing field, and nothing is written', async () => {
  const target = { url: 'http://127.0.0.1:9/' };
  const cases: [string, Record<string, unknown>, string][] = [
    ['missing name', { schedule: '* * * * *', target }, 'name'],
    ['bad name', jobBody('Bad Name'), 'name'],
    ['uuid-like name', jobBody('0f8fad5b-d9cb-469f-a165-70867728950e'), 'name'],
    ['bad cron', jobBody('x1', { schedule: '61 * * * *' }), 'schedule'],
    ['cron with 4 fields', jobBody('x2', { schedule: '* * * *' }), 'schedule'],
    ['bad zone', jobBody('x3', { timezone: 'Mars/Olympus' }), 'timezone'],
    ['ftp target', jobBody('x4', { target: { url: 'ftp://example.com/' } }), 'target.url'],
    ['relative url', jobBody('x5', { target: { url: '/hook' } }), 'target.url'],
    ['credentials in url', jobBody('x6', { target: { url: 'http://u:p@example.com/' } }), 'target.url'],
    ['unknown field', jobBody('x7', { color: 'red' }), 'color'],
    ['unknown target field', jobBody('x8', { target: { ...target, verb: 'GET' } }), 'target.verb'],
    ['timeout too small', jobBody('x9', { timeoutMs: 5 }), 'timeoutMs'],
    ['timeout not an integer', jobBody('x10', { timeoutMs: 1.5 }), 'timeoutMs'],
    ['timeout as a string', jobBody('x11', { timeoutMs: '5000' }), 'timeoutMs'],
    ['no attempts', jobBody('x12', { retry: { maxAttempts: 0, backoffMs: 1 } }), 'retry.maxAttempts'],
    [
      'huge multiplier',
      jobBody('x13', { retry: { maxAttempts: 2, backoffMs: 1, backoffMultiplier: 11 } }),
      'retry.backoffMultiplier',
    ],
    ['bad method', jobBody('x14', { target: { ...target, method: 'FETCH' } }), 'target.method'],
    ['bad concurrency', jobBody('x15', { concurrency: 'sometimes' }), 'concurrency'],
    ['bad misfire', jobBody('x16', { misfire: 'later' }), 'misfire'],
    ['catch-up out of range', jobBody('x17', { maxCatchUp: 0 }), 'maxCatchUp'],
    ['enabled as a string', jobBody('x18', { enabled: 'yes' }), 'enabled'],
    [
      'bad header name',
      jobBody('x19', { target: { ...target, headers: { 'a b': 'x' } } }),
      'target.headers.a b',
    ],
    [
      'header value with CRLF',
      jobBody('x20', { target: { ...target, headers: { 'x-a': 'v\r\nx: y' } } }),
      'target.headers.x-a',
    ],
    [
      'reserved header',
      jobBody('x21', { target: { ...target, headers: { Host: 'evil' } } }),
      'target.headers.Host',
    ],
    [
      'helios header',
      jobBody('x22', { target: { ...target, headers: { 'X-Helios-Run-Id': 'x' } } }),
      'target.headers.X-Helios-Run-Id',
    ],
    [
      'header twice',
      jobBody('x23', { target: { ...target, headers: { 'x-a': '1', 'X-A': '2' } } }),
      'target.headers.X-A',
    ],
    ['GET with a body', jobBody('x24', { target: { ...target, method: 'GET', body: 'x' } }), 'target.body'],
    [
      'NUL in a string',
      jobBody('x25', { target: { ...target, method: 'POST', body: 'a\u0000b' } }),
      'target.body',
    ],
    ['lone surrogate', jobBody('x26', { schedule: '* * * * *\ud800' }), 'schedule'],
    [
      'deep body',
      jobBody('x27', { target: { ...target, body: JSON.parse('['.repeat(40) + ']'.repeat(40)) } }),
      'target.body',
    ],
    [
      'metadata target',
      jobBody('x28', { target: { url: 'http://169.254.169.254/latest/meta-data/' } }),
      'target.url',
    ],
    [
      'stored-secret marker on create',
      jobBody('x29', { target: { ...target, headers: { authorization: '***' } } }),
      'target.headers.authorization',
    ],
    ['not an object', ['a'] as unknown as Record<string, unknown>, 'body'],
  ];
  const before = await jobCount();
  for (const [why, body, field] of cases) {
    const response = await api.call('POST', '/api/v1/jobs', { body });
    assert.equal(response.status, 400, `${why}: ${JSON.stringify(response.body)}`);
    assertProblem(response, 400, field);
  }
  assert.equal(await jobCount(), before);
});

test('a 400 lists every field failing the schema; once the schema passes, every field failing the later checks', async () => {
  const fields = (problem: ProblemResponse) => (problem.errors ?? []).map((e) => e.field).sort();
  const body = jobBody('two-stages', {
    schedule: '61 * * * *',
    timezone: 'Mars/Base',
    target: { url: 'ftp://127.0.0.1/' },
    timeoutMs: 5,
    retry: { maxAttempts: 0, backoffMs: 1 },
  });
  const shape = assertProblem(await api.call('POST', '/api/v1/jobs', { body }), 400);
  assert.deepEqual(fields(shape), ['retry.maxAttempts', 'timeoutMs']);
  const fixed = { ...body, timeoutMs: 1000, retry: { maxAttempts: 1, backoffMs: 1 } };
  const meaning = assertProblem(await api.call('POST', '/api/v1/jobs', { body: fixed }), 400);
  assert.deepEqual(fields(meaning), ['schedule', 'target.url', 'timezone']);
});

test('a target in 169.254.169.254 is rejected at save time, in every spelling', async () => {
  for (const url of [
    'http://169.254.169.254/',
    'http://2852039166/',
    'http://[::ffff:a9fe:a9fe]/',
    'http://[fe80::1]/',
  ]) {
    const response = await api.call('POST', '/api/v1/jobs', {
      body: jobBody('metadata', { target: { url } }),
    });
    const problem = assertProblem(response, 400, 'target.url');
    assert.match(JSON.stringify(problem), /denied range/);
  }
});

test('malformed JSON is a 400, a non-JSON type a 415, an oversized body a 413', async () => {
  assertProblem(await api.call('POST', '/api/v1/jobs', { raw: '{"name": ' }), 400, 'body');
  assertProblem(
    await api.call('POST', '/api/v1/jobs', { raw: 'name=x', headers: { 'content-type': 'text/plain' } }),
    415,
  );
  assertProblem(
    await api.call('POST', '/api/v1/jobs', {
      body: jobBody('big', { target: { url: 'http://127.0.0.1:9/', body: 'x'.repeat(300 * 1024) } }),
    }),
    413,
    'body',
  );
});

test('the body limit is configurable', async () => {
  const small = await startTestApi({ bodyLimit: 2048, db: api.db });
  try {
    const body = jobBody('limit', { target: { url: 'http://127.0.0.1:9/', body: 'x'.repeat(3000) } });
    assertProblem(await small.call('POST', '/api/v1/jobs', { body }), 413);
    assert.equal((await api.call('POST', '/api/v1/jobs', { body })).status, 201);
  } finally {
    await small.close();
  }
});

test('listing pages with opaque cursors is stable under concurrent inserts', async () => {
  const names = Array.from({ length: 7 }, (_, i) => `page-${i}`);
  for (const name of names) await api.call('POST', '/api/v1/jobs', { body: jobBody(name) });
  const seen: string[] = [];
  let cursor: string | null = null;
  let pages = 0;
  do {
    const query: string = `?limit=3${cursor ? `&cursor=${cursor}` : ''}`;
    const response = await api.call('GET', `/api/v1/jobs${query}`);
    assert.equal(response.status, 200);
    const page = response.body as { items: JobResponse[]; nextCursor: string | null };
    assert.ok(page.items.length <= 3);
    seen.push(...page.items.map((j) => j.name));
    cursor = page.nextCursor;
    pages += 1;
    // New jobs arrive while the client pages through the list.
    if (pages === 1) await api.call('POST', '/api/v1/jobs', { body: jobBody(`page-late-${pages}`) });
  } while (cursor);
  assert.equal(new Set(seen).size, seen.length, 'no job is listed twice');
  const pageJobs = seen.filter((n) => n.startsWith('page-') && !n.startsWith('page-late'));
  assert.deepEqual(pageJobs, names, 'every job, in creation order');
  assert.ok(seen.includes('page-late-1'), 'a job created during paging appears at the end');
  assert.equal(seen.length, await jobCount());
});

test('bad page parameters are 400 problems naming the parameter', async () => {
  assertProblem(await api.call('GET', '/api/v1/jobs?limit=0'), 400, 'limit');
  assertProblem(await api.call('GET', '/api/v1/jobs?limit=501'), 400, 'limit');
  assertProblem(await api.call('GET', '/api/v1/jobs?limit=ten'), 400, 'limit');
  assertProblem(await api.call('GET', '/api/v1/jobs?cursor=bm9wZQ'), 400, 'cursor');
  assertProblem(await api.call('GET', '/api/v1/jobs?sort=name'), 400, 'sort');
  const max = await api.call('GET', '/api/v1/jobs?limit=500');
  assert.equal(max.status, 200);
});

test('a job is read by id or by name; unknown ids and names are 404 problems', async () => {
  const created = (await api.call('POST', '/api/v1/jobs', { body: jobBody('read-me') })).body as JobResponse;
  const byId = await api.call('GET', `/api/v1/jobs/${created.id}`);
  assert.equal(byId.status, 200);
  assert.deepEqual(byId.body, created);
  assert.deepEqual((await api.call('GET', '/api/v1/jobs/read-me')).body, created);
  assert.deepEqual((await api.call('GET', `/api/v1/jobs/${created.id.toUpperCase()}`)).body, created);
  assertProblem(await api.call('GET', '/api/v1/jobs/00000000-0000-4000-8000-000000000000'), 404);
  assertProblem(await api.call('GET', '/api/v1/jobs/no-such-job'), 404);
  assertProblem(await api.call('GET', '/api/v1/jobs/NOT%20A%20NAME'), 404);
  assertProblem(await api.call('GET', '/api/v1/nowhere'), 404);
});

test('a job with the longest name allowed is read, paused, triggered, edited and deleted by name', async () => {
  const name = `long-${'n'.repeat(123)}`;
  assert.equal(name.length, 128);
  const created = await api.call('POST', '/api/v1/jobs', { body: jobBody(name) });
  assert.equal(created.status, 201, created.text);
  const path = `/api/v1/jobs/${name}`;
  assert.equal((await api.call('GET', path)).status, 200);
  assert.equal((await api.call('POST', `${path}/pause`)).status, 200);
  assert.equal((await api.call('POST', `${path}/trigger`)).status, 202);
  assert.equal((await api.call('GET', `${path}/runs`)).status, 200);
  assert.equal((await api.call('PATCH', path, { body: { timeoutMs: 2000 } })).status, 200);
  assert.equal((await api.call('DELETE', path)).status, 204);
  assertProblem(await api.call('GET', path), 404);
});

test('PATCH changes only the given fields and recomputes nextRunAt when the schedule changes', async () => {
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('patch-me') })).body as JobResponse;
  const slower = await api.call('PATCH', `/api/v1/jobs/${job.id}`, { body: { timeoutMs: 5000 } });
  assert.equal(slower.status, 200);
  const afterTimeout = slower.body as JobResponse;
  assert.equal(afterTimeout.timeoutMs, 5000);
  assert.equal(afterTimeout.nextRunAt, job.nextRunAt, 'same schedule, same next run');
  assert.equal(afterTimeout.schedule, job.schedule);
  assert.ok(afterTimeout.updatedAt > job.updatedAt);

  const daily = await api.call('PATCH', `/api/v1/jobs/patch-me`, {
    body: { schedule: '30 2 * * *', timezone: 'Europe/Paris' },
  });
  const rescheduled = daily.body as JobResponse;
  assert.equal(daily.status, 200);
  const { rows } = await api.db.pool.query<{ now: Date }>('SELECT now() AS now');
  const expected = parseCron('30 2 * * *', 'Europe/Paris').next(rows[0]!.now);
  assert.equal(rescheduled.nextRunAt, expected?.toISOString());
  assert.equal(rescheduled.timeoutMs, 5000, 'fields not given are kept');
});

test('PATCH errors: 400 with the field, 404, 409 on a taken name; the job is unchanged', async () => {
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('patch-errors') })).body as JobResponse;
  await api.call('POST', '/api/v1/jobs', { body: jobBody('taken') });
  assertProblem(
    await api.call('PATCH', `/api/v1/jobs/${job.id}`, { body: { timezone: 'Nowhere/Zone' } }),
    400,
    'timezone',
  );
  assertProblem(
    await api.call('PATCH', `/api/v1/jobs/${job.id}`, { body: { schedule: '' } }),
    400,
    'schedule',
  );
  assertProblem(await api.call('PATCH', `/api/v1/jobs/${job.id}`, { body: { id: job.id } }), 400, 'id');
  assertProblem(
    await api.call('PATCH', `/api/v1/jobs/${job.id}`, {
      body: { target: { url: 'http://169.254.169.254/' } },
    }),
    400,
    'target.url',
  );
  assertProblem(await api.call('PATCH', `/api/v1/jobs/${job.id}`, { body: { name: 'taken' } }), 409, 'name');
  assertProblem(await api.call('PATCH', '/api/v1/jobs/ghost', { body: { timeoutMs: 1000 } }), 404);
  const now = (await api.call('GET', `/api/v1/jobs/${job.id}`)).body;
  assert.deepEqual(now, job);
});

test('DELETE answers 204, removes the job and its runs, then 404', async () => {
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('delete-me') })).body as JobResponse;
  assert.equal((await api.call('POST', `/api/v1/jobs/${job.id}/trigger`)).status, 202);
  const deleted = await api.call('DELETE', `/api/v1/jobs/${job.id}`);
  assert.equal(deleted.status, 204);
  assert.equal(deleted.text, '');
  const { rows } = await api.db.pool.query('SELECT 1 FROM runs WHERE job_id = $1', [job.id]);
  assert.equal(rows.length, 0);
  assertProblem(await api.call('DELETE', `/api/v1/jobs/${job.id}`), 404);
  assertProblem(await api.call('GET', `/api/v1/jobs/${job.id}`), 404);
});

test("a manual run never takes an occurrence's instant (a whole second) nor its millisecond", async () => {
  // Triggered in the first millisecond of a second, the run once took the occurrence's slot (one
  // run per job and instant): the occurrence got no run. Shifted, not rounded, so that two
  // triggers in that millisecond stay two runs.
  const cases: [string, string][] = [
    ['2026-12-06T10:00:00.000000Z', '2026-12-06T10:00:00.001000Z'],
    ['2026-12-06T10:00:00.000400Z', '2026-12-06T10:00:00.001400Z'],
    ['2026-12-06T10:00:00.000999Z', '2026-12-06T10:00:00.001999Z'],
    ['2026-12-06T10:00:00.001000Z', '2026-12-06T10:00:00.001000Z'],
    ['2026-12-06T10:00:00.001500Z', '2026-12-06T10:00:00.001500Z'],
    ['2026-12-06T10:00:59.999999Z', '2026-12-06T10:00:59.999999Z'],
  ];
  for (const [clock, expected] of cases) {
    const { rows } = await api.db.pool.query<{ same: boolean; at: string }>(
      `SELECT ${manualRunInstant('$1::timestamptz')} = $2::timestamptz AS same,
              to_char(${manualRunInstant('$1::timestamptz')} AT TIME ZONE 'UTC', 'HH24:MI:SS.US') AS at`,
      [clock, expected],
    );
    assert.ok(rows[0]!.same, `asked at ${clock}: scheduled for ${rows[0]!.at}, expected ${expected}`);
  }
  // And the trigger uses it (its run is due when scheduled).
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('manual-instant') }))
    .body as JobResponse;
  assert.equal((await api.call('POST', `/api/v1/jobs/${job.id}/trigger`)).status, 202);
  const { rows } = await api.db.pool.query<{ ms: string }>(
    `SELECT (extract(microseconds FROM scheduled_for)::bigint % 1000000) / 1000.0 AS ms
     FROM runs WHERE job_id = $1 AND trigger = 'manual' AND not_before = scheduled_for`,
    [job.id],
  );
  assert.equal(rows.length, 1);
  assert.ok(Number(rows[0]!.ms) >= 1, `scheduled ${rows[0]!.ms} ms into its second`);
});

test('triggers at the same instant are each a run with its dispatch message', async () => {
  // Triggers whose clocks meet (the same microsecond, or one in a second's first millisecond and
  // one a millisecond later: manualRunInstant maps both to one instant) once made the later a no-op,
  // answered 409. Here another session's trigger has committed a run at this transaction's instant,
  // and two more triggers follow in the transaction, whose now() stays the same.
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('same-instant') })).body as JobResponse;
  const client = await api.db.pool.connect();
  const ids: (string | null)[] = [];
  try {
    await client.query('BEGIN');
    const asked = await client.query<{ at: string }>(`SELECT ${manualRunInstant('now()')}::text AS at`);
    const [other] = await queuedRuns(api.db.pool, job.id, [`'${asked.rows[0]!.at}'`], 'manual');
    for (let i = 0; i < 2; i += 1) ids.push((await createManualRun(client, job.id, api.runsTopic)).runId);
    await client.query('COMMIT');
    assert.ok(
      ids.every((id) => id !== null && id !== other),
      `run ids: ${JSON.stringify(ids)}`,
    );
  } finally {
    client.release();
  }
  const { rows } = await api.db.pool.query<{ id: string; ms: string; announced: boolean }>(
    `SELECT r.id, (extract(microseconds FROM r.scheduled_for)::bigint % 1000000) / 1000.0 AS ms,
            EXISTS (SELECT 1 FROM outbox o WHERE o.topic = $2 AND o.payload->>'runId' = r.id::text) AS announced
     FROM runs r WHERE r.id = ANY($1::uuid[])`,
    [ids, api.runsTopic],
  );
  assert.equal(rows.length, 2);
  for (const row of rows) {
    assert.ok(row.announced, `run ${row.id} has no outbox row`);
    assert.ok(Number(row.ms) >= 1, `scheduled ${row.ms} ms into its second`);
  }
  // A job that does not exist still gets none.
  assert.deepEqual(
    await createManualRun(api.db.pool, '00000000-0000-4000-8000-000000000000', api.runsTopic),
    { runId: null, why: 'no-job' },
  );
});

test('a trigger racing a delete of its job is a 404, not a 409 to try again; nothing is written', async () => {
  // The trigger reads the job, then inserts its run; the job's delete commits between the two.
  // The insert's foreign-key check waits on the deleting transaction's row lock, then finds the job
  // gone. That was answered 409 "try again", and the retry got 404.
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('trigger-vs-delete') }))
    .body as JobResponse;
  const deleting = await api.db.pool.connect();
  try {
    await deleting.query('BEGIN');
    await deleting.query('DELETE FROM jobs WHERE id = $1', [job.id]);
    const answer = api.call('POST', `/api/v1/jobs/${job.id}/trigger`);
    await untilWaitingForLocks(api.db.pool, { fragment: 'INSERT INTO runs', timeoutMs: 10_000, everyMs: 10 });
    await deleting.query('COMMIT');
    assertProblem(await answer, 404);
  } finally {
    deleting.release();
  }
  const { rows } = await api.db.pool.query<{ n: number }>(
    `SELECT (SELECT count(*) FROM runs WHERE job_id = $1)::int
          + (SELECT count(*) FROM outbox WHERE key = $1::text)::int AS n`,
    [job.id],
  );
  assert.equal(rows[0]!.n, 0, 'a run or an outbox row of the deleted job was written');
});

let fakeClock: Promise<unknown> | undefined;

/** A session whose now() is `clock` (a function earlier on its search_path than pg_catalog's). */
async function sessionAt(clock: string): Promise<pg.Client> {
  fakeClock ??= api.db.pool.query(`CREATE SCHEMA fake_clock;
    CREATE FUNCTION fake_clock.now() RETURNS timestamptz LANGUAGE sql
    AS $$ SELECT current_setting('helios_test.now')::timestamptz $$`);
  await fakeClock;
  const client = new pg.Client({
    connectionString: api.db.url,
    options: `-c TimeZone=UTC -c search_path=fake_clock,pg_catalog,public -c helios_test.now=${clock}`,
  });
  await client.connect();
  return client;
}

/** Resolves once all the sessions wait for a lock; fails after 10 s. */
async function allWaitForLocks(sessions: pg.Client[]): Promise<void> {
  const pids = sessions.map((s) => (s as unknown as { processID: number }).processID);
  for (const deadline = Date.now() + 10_000; ;) {
    assert.ok(Date.now() < deadline, 'the triggers did not all wait for the run at their instant');
    const { rows } = await api.db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM pg_stat_activity
       WHERE pid = ANY($1) AND wait_event_type = 'Lock'`,
      [pids],
    );
    if (rows[0]!.n === pids.length) return;
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

test('triggers from separate sessions whose clocks meet, queued behind a run at their instant, are each a run', async () => {
  // Four autocommit triggers whose now() is two microseconds before a whole second wait on another
  // session's trigger at that instant, in a transaction; then it commits. Each steps past the
  // others (into the next second, off its first millisecond, clear of the occurrence there): five
  // runs in all, as many as createManualRun's tries, each with its dispatch message.
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('clocks-meet') })).body as JobResponse;
  const clock = '2026-12-06T10:00:00.999998Z';
  await queuedRuns(api.db.pool, job.id, [`'2026-12-06T10:00:01Z'`]);
  const sessions = await Promise.all([0, 1, 2, 3].map(() => sessionAt(clock)));
  const holder = await sessionAt(clock);
  try {
    await holder.query('BEGIN');
    assert.ok((await createManualRun(holder, job.id, api.runsTopic)).runId);
    const triggers = sessions.map(async (s) => (await createManualRun(s, job.id, api.runsTopic)).runId);
    await allWaitForLocks(sessions);
    await holder.query('COMMIT');
    const ids = await Promise.all(triggers);
    assert.ok(
      ids.every((id) => id !== null),
      `run ids: ${JSON.stringify(ids)}`,
    );
  } finally {
    await Promise.all([holder, ...sessions].map((s) => s.end()));
  }
  const { rows } = await api.db.pool.query<{ at: string; trigger: string; announced: boolean }>(
    `SELECT to_char(r.scheduled_for AT TIME ZONE 'UTC', 'SS.US') AS at, r.trigger,
            EXISTS (SELECT 1 FROM outbox o WHERE o.topic = $2 AND o.payload->>'runId' = r.id::text) AS announced
     FROM runs r WHERE r.job_id = $1 ORDER BY r.scheduled_for`,
    [job.id, api.runsTopic],
  );
  assert.deepEqual(
    rows.map((r) => `${r.at} ${r.trigger}${r.trigger === 'manual' && !r.announced ? ' unannounced' : ''}`),
    [
      '00.999998 manual',
      '00.999999 manual',
      '01.000000 schedule',
      '01.001000 manual',
      '01.001001 manual',
      '01.001002 manual',
    ],
  );
});
