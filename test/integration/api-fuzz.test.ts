import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import fc from 'fast-check';
import { MAX_PARAM_LENGTH } from '../../src/api/framework-errors.js';
import { isValidTimezone, parseCron } from '../../src/scheduling/cron.js';
import { checkTargetUrl, compileTargetPolicy } from '../../src/security/target-policy.js';
import { jobBody, rawRequest, startTestApi, tableState, type TestApi } from '../support/api.js';

// Property: whatever malformed body arrives, the answer is a 4xx problem+json and the jobs
// table is exactly as it was (nothing half-written).

let api: TestApi;
let existingId: string;
before(async () => {
  api = await startTestApi();
  const created = await api.call('POST', '/api/v1/jobs', { body: jobBody('fuzz-existing') });
  existingId = (created.body as { id: string }).id;
});
after(() => api.close());

const policy = compileTargetPolicy();
const KNOWN = new Set([
  'name',
  'schedule',
  'timezone',
  'target',
  'timeoutMs',
  'retry',
  'concurrency',
  'misfire',
  'maxCatchUp',
  'enabled',
]);

const notCron = (s: string) => {
  try {
    parseCron(s);
    return s.length > 256;
  } catch {
    return true;
  }
};
const notZone = (s: string) => s === '' || s.length > 64 || !isValidTimezone(s);
const notName = (s: string) => !/^[a-z0-9][a-z0-9._-]{0,127}$/.test(s) || s.length > 128;
const notUrl = (s: string) => s === '' || s.length > 2048 || checkTargetUrl(s, policy) !== null;

const oddStrings = fc.oneof(
  fc.constantFrom(
    "'; DROP TABLE jobs; --",
    "x' OR '1'='1",
    '$1',
    '\\\\',
    '\u0000',
    'a\u0000b',
    '\ud800',
    '\udfff abc',
    '\u202e* * * * *',
    '\u200b',
    '５ * * * *',
    '🕐 * * * *',
    'Ω',
    '../../etc/passwd',
    '%00',
    '${jndi:ldap://x}',
    '<script>alert(1)</script>',
    ' ',
    '',
  ),
  fc.string({ unit: 'binary' }),
  fc.string({ unit: 'grapheme', maxLength: 40 }),
);
const hugeString = fc.integer({ min: 3000, max: 20_000 }).map((n) => 'x'.repeat(n));
const wrongType = fc.oneof(
  fc.integer(),
  fc.double(),
  fc.boolean(),
  fc.constant(null),
  fc.array(fc.jsonValue(), { maxLength: 3 }),
  fc.dictionary(fc.string({ maxLength: 5 }), fc.jsonValue(), { maxKeys: 3 }),
);
const nonString = wrongType;
const nonObject = fc.oneof(
  fc.string(),
  fc.integer(),
  fc.boolean(),
  fc.constant(null),
  fc.array(fc.integer()),
);
const badInt = (min: number, max: number) =>
  fc.oneof(
    fc.integer({ max: min - 1 }),
    fc.integer({ min: max + 1 }),
    fc.double({ noInteger: true, noNaN: true, noDefaultInfinity: true }),
    fc.string(),
    fc.boolean(),
    fc.constant(null),
  );
const deep = (depth: number, leaf = '1') => '{"a":'.repeat(depth) + leaf + '}'.repeat(depth);
// Deeply nested values are spliced into the JSON text: JSON.stringify itself would overflow the stack.
const deepMarker = (depth: number) => `__deep_${depth}__`;
const expandDeep = (raw: string) =>
  raw.replace(/"__deep_(\d+)__"/g, (_, depth: string) => deep(Number(depth)));

type Mutation = (body: Record<string, unknown>) => void;
const set =
  (key: string, value: unknown): Mutation =>
  (body) => {
    body[key] = value;
  };
const setTarget =
  (key: string, value: unknown): Mutation =>
  (body) => {
    body.target = { ...(body.target as object), [key]: value };
  };

/** One invalid change to an otherwise valid job. */
const mutation: fc.Arbitrary<Mutation> = fc.oneof(
  fc.oneof(nonString, oddStrings.filter(notName), hugeString).map((v) => set('name', v)),
  fc
    .oneof(nonString, oddStrings.filter(notCron), fc.string().filter(notCron), hugeString)
    .map((v) => set('schedule', v)),
  fc
    .constantFrom(
      '61 * * * *',
      '* * * *',
      '* * * * * * *',
      '*/0 * * * *',
      '0 0 30 2 *',
      'L * * * *',
      '0:0 * * * *',
    )
    .map((v) => set('schedule', v)),
  fc
    .oneof(nonString, oddStrings.filter(notZone), fc.string().filter(notZone), hugeString)
    .map((v) => set('timezone', v)),
  fc
    .constantFrom('Mars/Olympus', 'UTC+25', 'Europe/Nowhere', 'utc ', 'GMT; DROP')
    .map((v) => set('timezone', v)),
  nonObject.map((v) => set('target', v)),
  fc
    .oneof(
      nonString,
      oddStrings.filter(notUrl),
      fc.webUrl().map((u) => u.replace(/^https?/, 'ftp')),
      hugeString,
    )
    .map((v) => setTarget('url', v)),
  fc
    .constantFrom(
      'http://169.254.169.254/',
      'http://[fe80::1]/',
      'http://0xA9FEA9FE/',
      'javascript:alert(1)',
      'http://u:p@h/',
    )
    .map((v) => setTarget('url', v)),
  fc
    .oneof(
      nonString,
      fc.string().filter((s) => !['GET', 'HEAD', 'POST', 'PUT', 'PATCH', 'DELETE', 'OPTIONS'].includes(s)),
    )
    .map((v) => setTarget('method', v)),
  fc
    .oneof(
      nonObject,
      fc.constantFrom(
        { 'bad name': 'x' },
        { 'x-a': 'line\r\nbreak' },
        { Host: 'evil' },
        { 'Content-Length': '1' },
        { 'x-helios-attempt': '9' },
        { 'x-a': 1 },
        { 'x-a': 'v', 'X-A': 'w' },
        { authorization: '***' },
        { 'x-a': 'x'.repeat(9000) },
      ),
      fc
        .integer({ min: 65, max: 120 })
        .map((n) => Object.fromEntries(Array.from({ length: n }, (_, i) => [`h${i}`, 'v']))),
    )
    .map((v) => setTarget('headers', v)),
  fc.integer({ min: 33, max: 5000 }).map((d) => setTarget('body', deepMarker(d))),
  fc.constant<Mutation>((body) => {
    body.target = { url: 'http://127.0.0.1:9/', method: 'GET', body: { a: 1 } };
  }),
  fc.constantFrom('\u0000', 'a\ud800').map((s) => setTarget('body', { text: s })),
  fc
    .string()
    .filter((k) => !['url', 'method', 'headers', 'body'].includes(k) && k !== '__proto__')
    .map((k) => setTarget(k, 1)),
  badInt(100, 3_600_000).map((v) => set('timeoutMs', v)),
  badInt(1, 10_000).map((v) => set('maxCatchUp', v)),
  fc
    .oneof(
      nonObject,
      fc.record({ maxAttempts: badInt(1, 100), backoffMs: fc.integer({ min: 0, max: 1000 }) }),
      fc.record({ maxAttempts: fc.integer({ min: 1, max: 100 }), backoffMs: badInt(0, 86_400_000) }),
      fc.constant({ maxAttempts: 3 }),
      fc.constant({ maxAttempts: 3, backoffMs: 1, backoffMultiplier: 0.5 }),
      fc.constant({ maxAttempts: 3, backoffMs: 1, jitter: true }),
    )
    .map((v) => set('retry', v)),
  fc
    .oneof(
      nonString,
      fc.string().filter((s) => !['allow', 'forbid', 'replace'].includes(s)),
    )
    .map((v) => set('concurrency', v)),
  fc
    .oneof(
      nonString,
      fc.string().filter((s) => !['fire-once', 'fire-all', 'skip'].includes(s)),
    )
    .map((v) => set('misfire', v)),
  fc.oneof(fc.string(), fc.integer(), fc.constant(null)).map((v) => set('enabled', v)),
  fc
    .tuple(
      fc.string({ minLength: 1 }).filter((k) => !KNOWN.has(k) && k !== '__proto__'),
      fc.jsonValue(),
    )
    .map(([k, v]) => set(k, v)),
  fc.integer({ min: 100, max: 20_000 }).map((d) => set('extra', deepMarker(d))),
);

/** A malformed request: a job with 1-3 invalid changes, or a body that is not a job at all. */
type Malformed = { raw: string; contentType?: string; patch: boolean };
const malformed: fc.Arbitrary<Malformed> = fc.oneof(
  {
    weight: 8,
    arbitrary: fc
      .record({
        name: fc.stringMatching(/^fz-[a-z0-9]{1,12}$/),
        mutations: fc.array(mutation, { minLength: 1, maxLength: 3 }),
        patch: fc.boolean(),
      })
      .map(({ name, mutations, patch }) => {
        const body = jobBody(name) as Record<string, unknown>;
        for (const mutate of mutations) mutate(body);
        return { raw: expandDeep(JSON.stringify(body)), patch };
      }),
  },
  {
    weight: 1,
    arbitrary: fc.record({
      raw: fc.oneof(
        fc.constantFrom(
          '',
          '{',
          '{"name":',
          '[',
          'null',
          '42',
          '"job"',
          'true',
          '[]',
          '{"a":1,}',
          "{'a':1}",
          'NaN',
        ),
        fc.constantFrom('{"__proto__":{"admin":true}}', '{"constructor":{"prototype":{"x":1}}}'),
        fc.constantFrom(
          '{"timeoutMs": 1e400, "name":"x","schedule":"* * * * *","target":{"url":"http://a/"}}',
        ),
        fc.string().filter((s) => {
          try {
            JSON.parse(s);
            return false;
          } catch {
            return true;
          }
        }),
        fc
          .jsonValue()
          .filter((v) => typeof v !== 'object' || v === null || Array.isArray(v))
          .map((v) => JSON.stringify(v)),
        fc.integer({ min: 30_000, max: 60_000 }).map((d) => deep(d)),
        fc.integer({ min: 270_000, max: 400_000 }).map((n) => JSON.stringify({ name: 'x'.repeat(n) })),
      ),
      patch: fc.boolean(),
    }),
  },
  {
    weight: 1,
    arbitrary: fc.record({
      raw: fc.constant(JSON.stringify(jobBody('fz-type'))),
      contentType: fc.constantFrom(
        'text/plain',
        'application/x-www-form-urlencoded',
        'application/xml',
        'multipart/form-data; boundary=x',
      ),
      patch: fc.boolean(),
    }),
  },
  {
    // Missing required fields (only a create needs them).
    weight: 1,
    arbitrary: fc.constantFrom('name', 'schedule', 'target').map((key) => {
      const body = jobBody('fz-missing') as Record<string, unknown>;
      delete body[key];
      return { raw: JSON.stringify(body), patch: false };
    }),
  },
);

test('at least 500 malformed bodies each get a 4xx problem+json and leave the jobs table unchanged', async () => {
  const before = await tableState(api);
  let sent = 0;
  await fc.assert(
    fc.asyncProperty(malformed, async ({ raw, contentType, patch }) => {
      const path = patch ? `/api/v1/jobs/${existingId}` : '/api/v1/jobs';
      const response = await api.call(patch ? 'PATCH' : 'POST', path, {
        raw,
        headers: { 'content-type': contentType ?? 'application/json' },
      });
      sent += 1;
      assert.ok(
        response.status >= 400 && response.status < 500,
        `${response.status} for ${raw.slice(0, 200)}`,
      );
      assert.match(response.headers.get('content-type') ?? '', /^application\/problem\+json/);
      const problem = response.body as {
        status: number;
        title: string;
        errors?: { field: string; message: string }[];
      };
      assert.equal(problem.status, response.status);
      assert.equal(typeof problem.title, 'string');
      for (const error of problem.errors ?? []) {
        assert.equal(typeof error.field, 'string');
        assert.equal(typeof error.message, 'string');
      }
      if (response.status === 400)
        assert.ok(problem.errors?.length, `a 400 names a field: ${raw.slice(0, 200)}`);
      assert.equal(await tableState(api), before, `the jobs table changed after ${raw.slice(0, 200)}`);
    }),
    { numRuns: 600 },
  );
  assert.ok(sent >= 500, `only ${sent} bodies were sent`);
});

/** What every rejected request must look like: a 4xx problem+json whose 400 names a field. */
function assertProblem(response: Awaited<ReturnType<TestApi['call']>>, status: number, what: string) {
  assert.equal(response.status, status, `${what}: ${response.text.slice(0, 300)}`);
  assert.match(response.headers.get('content-type') ?? '', /^application\/problem\+json/, what);
  const problem = response.body as { status: number; errors?: { field: string; message: string }[] };
  assert.equal(problem.status, status, what);
  return problem;
}

/** Paths Fastify's router cannot decode: bad or truncated percent-escapes, bytes that are not UTF-8. */
const undecodableSegment = fc
  .tuple(
    fc.stringMatching(/^[a-z0-9-]{0,6}$/),
    fc.constantFrom('%ff', '%', '%zz', 'a%2', '%e0%80', '%c0%af', '%ed%a0%80', '%fe%ff', '%80'),
    // No hex digit right after: it would complete a truncated escape.
    fc.stringMatching(/^[g-z-]{0,6}$/),
  )
  .map((parts) => parts.join(''));

test('a path parameter that is not valid percent-encoding is a 400 problem naming it, on every route that has one', async () => {
  const doc = (await api.call('GET', '/openapi.json')).body as {
    paths: Record<string, Record<string, unknown>>;
  };
  const routes = Object.entries(doc.paths).flatMap(([path, item]) =>
    path.includes('{id}') ? Object.keys(item).map((method) => ({ method: method.toUpperCase(), path })) : [],
  );
  assert.ok(routes.length >= 9, `only ${routes.length} routes with an {id}`);
  const before = await tableState(api);
  await fc.assert(
    fc.asyncProperty(fc.constantFrom(...routes), undecodableSegment, async ({ method, path }, segment) => {
      const url = path.replace('{id}', segment);
      const body = method === 'PATCH' ? { timeoutMs: 2000 } : undefined;
      const problem = assertProblem(await api.call(method, url, { body }), 400, `${method} ${url}`);
      assert.deepEqual(
        problem.errors?.map((e) => e.field),
        ['id'],
        `${method} ${url}`,
      );
    }),
    { numRuns: 100 },
  );
  assert.equal(await tableState(api), before);
});

test('an undecodable path outside a route parameter is a 400 problem naming the path', async () => {
  for (const path of [
    '/readyz/%ff',
    '/healthz/%',
    '/metrics/%ff',
    '/docs/%ff',
    '/api/v1/%ff',
    '/api/v1/nothing/%e0%80',
  ]) {
    const problem = assertProblem(await api.call('GET', path), 400, path);
    assert.deepEqual(
      problem.errors?.map((e) => e.field),
      ['path'],
      path,
    );
  }
  // A method the route does not serve: the segment is no parameter of any route.
  const problem = assertProblem(await api.call('PUT', '/api/v1/jobs/%ff'), 400, 'PUT');
  assert.deepEqual(
    problem.errors?.map((e) => e.field),
    ['path'],
  );
});

test('a path parameter longer than the router takes is a 400 problem naming it', async () => {
  const long = 'a'.repeat(MAX_PARAM_LENGTH + 1);
  for (const path of [`/api/v1/jobs/${long}`, `/api/v1/runs/${long}`, `/api/v1/jobs/${long}/runs`]) {
    const problem = assertProblem(await api.call('GET', path), 400, path);
    assert.deepEqual(
      problem.errors?.map((e) => e.field),
      ['id'],
      path,
    );
  }
  const problem = assertProblem(await api.call('POST', `/api/v1/dead-letters/${long}/replay`), 400, 'replay');
  assert.deepEqual(
    problem.errors?.map((e) => e.field),
    ['id'],
  );
});

test('errors outside /api/v1 are problems too: an unknown path, a body the server cannot parse', async () => {
  for (const [method, path] of [
    ['GET', '/nowhere'],
    ['POST', '/metrics'],
    ['GET', '/docs/nothing-here'],
  ] as const) {
    assertProblem(await api.call(method, path), 404, `${method} ${path}`);
  }
  const problem = assertProblem(await api.call('POST', '/readyz', { raw: '{"a":' }), 400, 'bad JSON');
  assert.deepEqual(
    problem.errors?.map((e) => e.field),
    ['body'],
  );
  assertProblem(
    await api.call('POST', '/healthz', { raw: 'x'.repeat(300 * 1024) }),
    413,
    'a body past the limit',
  );
});

test('requests the HTTP parser refuses get a problem+json naming what is malformed', async () => {
  const start = 'POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n';
  const cases = [
    [`${start}Content-Length: abc\r\n\r\n{}`, 400, 'headers.content-length'],
    [`${start}Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}`, 400, 'headers.content-length'],
    [`${start}Bad Header: x\r\nContent-Length: 2\r\n\r\n{}`, 400, 'headers'],
    [`${start}Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n`, 400, 'body'],
    [`GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ${'x'.repeat(20_000)}\r\n\r\n`, 431, 'headers'],
  ] as const;
  for (const [request, status, field] of cases) {
    const what = request.slice(start.length, start.length + 60);
    const answer = await rawRequest(api, request);
    assert.equal(answer.status, status, what);
    assert.match(answer.contentType, /^application\/problem\+json/, what);
    const problem = answer.body as { status: number; errors?: { field: string }[] };
    assert.equal(problem.status, status, what);
    assert.deepEqual(
      problem.errors?.map((e) => e.field),
      [field],
      what,
    );
  }
});
