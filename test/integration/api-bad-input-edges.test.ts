import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { jobBody, rawRequest, startTestApi, tableState, type TestApi } from '../support/api.js';

// Inputs that passed every check the API makes of its own and failed (or changed) later: in
// PostgreSQL, answered for the wrong field, or in JSON.parse, stored as something else.

let api: TestApi;
let jobId: string;
before(async () => {
  api = await startTestApi();
  const created = await api.call('POST', '/api/v1/jobs', { body: jobBody('edges-existing') });
  jobId = (created.body as { id: string }).id;
});
after(() => api.close());

function assertFields(response: Awaited<ReturnType<TestApi['call']>>, fields: string[], what: string) {
  assert.equal(response.status, 400, `${what}: ${response.text.slice(0, 300)}`);
  assert.match(response.headers.get('content-type') ?? '', /^application\/problem\+json/, what);
  const problem = response.body as { errors?: { field: string }[] };
  assert.deepEqual(
    problem.errors?.map((e) => e.field),
    fields,
    what,
  );
}

const cursorOf = (ts: string) =>
  Buffer.from(JSON.stringify([ts, '00000000-0000-4000-8000-000000000000'])).toString('base64url');

test('a cursor whose timestamp has the right shape but is no instant is a 400 naming cursor on every list', async () => {
  // Each passes the cursor's shape check, and PostgreSQL refused it (a data exception): the answer
  // named `body`, which these GETs do not have.
  const timestamps = [
    '2026-13-01 00:00:00+00',
    '2026-02-30 00:00:00+00',
    '2025-02-29 00:00:00+00',
    '0000-01-01 00:00:00+00',
    '2026-02-28 25:00:00+00',
    '2026-02-28 23:61:00+00',
    '2026-02-28 23:00:61+00',
    '2026-02-28 23:00:00+16',
    '2026-02-28 23:00:00+05:60',
  ];
  const before = await tableState(api);
  for (const ts of timestamps) {
    for (const list of ['/api/v1/jobs', `/api/v1/jobs/${jobId}/runs`, '/api/v1/dead-letters']) {
      assertFields(await api.call('GET', `${list}?cursor=${cursorOf(ts)}`), ['cursor'], `${list} ${ts}`);
    }
  }
  // A leap day and the widest offsets PostgreSQL takes are instants: still a page.
  for (const ts of ['2024-02-29 00:00:00+00', '2026-12-31 23:59:59.999999-15:59', '0001-01-01 00:00:00+00']) {
    const response = await api.call('GET', `/api/v1/jobs?cursor=${cursorOf(ts)}`);
    assert.equal(response.status, 200, `${ts}: ${response.text.slice(0, 300)}`);
  }
  assert.equal(await tableState(api), before);
});

test('a number in target.body beyond what JSON numbers can hold here is a 400 naming it, not stored as null', async () => {
  // JSON.parse reads 1e999 as Infinity, which JSON.stringify writes as null: the job was saved
  // with a body other than the one sent.
  const before = await tableState(api);
  const raw = (body: string) =>
    `{"name":"edges-huge","schedule":"* * * * *","target":{"url":"http://127.0.0.1:9/","body":${body}}}`;
  assertFields(
    await api.call('POST', '/api/v1/jobs', { raw: raw('{"amount":1e999}') }),
    ['target.body.amount'],
    'create',
  );
  assertFields(
    await api.call('POST', '/api/v1/jobs', { raw: raw('[1,[-1e400]]') }),
    ['target.body.1.0'],
    'create, nested',
  );
  assertFields(await api.call('POST', '/api/v1/jobs', { raw: raw('1e309') }), ['target.body'], 'create, top');
  assertFields(
    await api.call('PATCH', `/api/v1/jobs/${jobId}`, {
      raw: '{"target":{"url":"http://127.0.0.1:9/","body":{"amount":1e999}}}',
    }),
    ['target.body.amount'],
    'patch',
  );
  assert.equal(await tableState(api), before);
  // The largest finite numbers are kept as sent.
  const created = await api.call('POST', '/api/v1/jobs', { raw: raw('[1.7976931348623157e308,-5e-324]') });
  assert.equal(created.status, 201, created.text);
  assert.deepEqual(
    (created.body as { target: { body: unknown } }).target.body,
    [1.7976931348623157e308, -5e-324],
  );
});

test('a QUERY request without a content type is a 400 naming the header, on any path', async () => {
  // Fastify refuses it before routing (RFC 10008: a QUERY must say what its content is); the
  // answer said only that "the request was rejected", for a body.
  for (const path of ['/api/v1/jobs', `/api/v1/jobs/${jobId}`, '/healthz', '/nowhere']) {
    assertFields(await api.call('QUERY', path), ['headers.content-type'], `QUERY ${path}`);
  }
});

test('a page size that is not written as a whole number is a 400 naming limit, not read as one', async () => {
  // The query string is converted before it is checked, and the conversion read 1.5 as 1,
  // `true` as 1 and 0x10 as 16: a page of another size than asked, answered 200.
  for (const limit of ['1.5', '1.9999999999999999', 'true', '0x10', '0b11', '1e1', '%205']) {
    for (const list of ['/api/v1/jobs', `/api/v1/jobs/${jobId}/runs`, '/api/v1/dead-letters']) {
      assertFields(await api.call('GET', `${list}?limit=${limit}`), ['limit'], `${list} limit=${limit}`);
    }
  }
  for (const limit of ['1', '007', '500']) {
    const response = await api.call('GET', `/api/v1/jobs?limit=${limit}`);
    assert.equal(response.status, 200, `limit=${limit}: ${response.text.slice(0, 300)}`);
  }
});

test('requests Node.js refuses before Fastify sees them get a problem naming what is wrong', async () => {
  // Node answered these itself (a 400 and a 417 with empty bodies, CONNECT with no answer at all)
  // or served them (two Hosts).
  const job = JSON.stringify(jobBody('edges-expect'));
  const cases = [
    ['GET /api/v1/jobs HTTP/1.1\r\nConnection: close\r\n\r\n', 400, 'headers.host'],
    ['GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n', 400, 'headers.host'],
    // Node keeps the first Host and drops the others; RFC 9112 §3.2 asks for a 400.
    [
      'GET /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n',
      400,
      'headers.host',
    ],
    [
      'POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nExpect: 200-ok\r\n' +
        `Content-Type: application/json\r\nContent-Length: ${Buffer.byteLength(job)}\r\n\r\n${job}`,
      417,
      'headers.expect',
    ],
    ['CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n', 400, 'method'],
  ] as const;
  const before = await tableState(api);
  for (const [request, status, field] of cases) {
    const what = request.slice(0, 40);
    const answer = await rawRequest(api, request);
    assert.equal(answer.status, status, `${what}: ${JSON.stringify(answer.body)}`);
    assert.match(answer.contentType, /^application\/problem\+json/, what);
    const problem = answer.body as { status: number; errors?: { field: string }[] };
    assert.equal(problem.status, status, what);
    assert.deepEqual(
      problem.errors?.map((e) => e.field),
      [field],
      what,
    );
  }
  assert.equal(await tableState(api), before);
  // HTTP/1.0 has no Host requirement, and Expect: 100-continue is answered as before.
  assert.equal((await rawRequest(api, 'GET /healthz HTTP/1.0\r\n\r\n')).status, 200);
  const continued = await rawRequest(
    api,
    'GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nExpect: 100-continue\r\n\r\n',
  );
  assert.equal(continued.status, 100);
});

test('a body that is not UTF-8, or says it is in another charset, is refused, not stored with U+FFFD in it', async () => {
  // The body was decoded as UTF-8 with replacement: café sent in latin-1 (or any invalid byte)
  // was saved as "caf\uFFFD", 201. JSON between systems is UTF-8 (RFC 8259 §8.1).
  const job = (name: string, text: Buffer) =>
    Buffer.concat([
      Buffer.from(`{"name":"${name}","schedule":"* * * * *","target":{"url":"http://127.0.0.1:9/","body":"`),
      text,
      Buffer.from('"}}'),
    ]);
  const patch = (text: Buffer) =>
    Buffer.concat([Buffer.from('{"target":{"url":"http://127.0.0.1:9/","body":"'), text, Buffer.from('"}}')]);
  const send = async (method: string, path: string, body: Buffer, contentType = 'application/json') => {
    const response = await fetch(`${api.url}${path}`, {
      method,
      headers: { 'content-type': contentType, 'x-helios-client': 'test' },
      body,
    });
    const text = await response.text();
    return { status: response.status, headers: response.headers, text, body: JSON.parse(text) as unknown };
  };
  const before = await tableState(api);
  const latin1 = Buffer.from('caf\xe9', 'latin1');
  for (const bytes of [
    latin1,
    Buffer.from([0x63, 0xc3, 0x28]),
    Buffer.from([0xc0, 0xaf]),
    Buffer.from([0xed, 0xa0, 0x80]),
  ]) {
    assertFields(
      await send('POST', '/api/v1/jobs', job('edges-bytes', bytes)),
      ['body'],
      `create ${bytes.toString('hex')}`,
    );
    assertFields(
      await send('PATCH', `/api/v1/jobs/${jobId}`, patch(bytes)),
      ['body'],
      `patch ${bytes.toString('hex')}`,
    );
  }
  // Valid UTF-8 that means something else in the charset the client names.
  for (const contentType of ['application/json; charset=latin1', 'application/json; charset="UTF-16"']) {
    const response = await send(
      'POST',
      '/api/v1/jobs',
      job('edges-charset', Buffer.from('café')),
      contentType,
    );
    assert.equal(response.status, 415, contentType);
    assert.match(response.headers.get('content-type') ?? '', /^application\/problem\+json/);
    assert.deepEqual(
      (response.body as { errors?: { field: string }[] }).errors?.map((e) => e.field),
      ['headers.content-type'],
    );
  }
  assert.equal(await tableState(api), before);
  for (const contentType of [
    'application/json',
    'application/json; charset=utf-8',
    'application/json;charset="UTF-8"',
  ]) {
    const name = `edges-utf8-${contentType.length}`;
    const created = await send('POST', '/api/v1/jobs', job(name, Buffer.from('café ☕ 😀')), contentType);
    assert.equal(created.status, 201, `${contentType}: ${created.text}`);
    assert.equal((created.body as { target: { body: unknown } }).target.body, 'café ☕ 😀');
  }
});

test('64 or more unknown fields are a 400 naming them, as fewer are', async () => {
  // TypeBox reports an unknown field twice, once on its own and once with its siblings, the
  // latter last: past its 64 errors only the former were left, which were skipped, and the 400
  // named nothing at all (errors: []).
  const unknown = (n: number, prefix: string) =>
    Object.fromEntries(Array.from({ length: n }, (_, i) => [`${prefix}${i}`, 'v']));
  const expected = (prefix: string) => Array.from({ length: 20 }, (_, i) => `${prefix}${i}`);
  const before = await tableState(api);
  for (const n of [64, 200]) {
    assertFields(
      await api.call('POST', '/api/v1/jobs', { body: { ...jobBody('edges-many'), ...unknown(n, 'x') } }),
      expected('x'),
      `create, ${n} unknown`,
    );
    assertFields(
      await api.call('PATCH', `/api/v1/jobs/${jobId}`, { body: unknown(n, 'x') }),
      expected('x'),
      `patch, ${n} unknown`,
    );
    const headers = unknown(Math.min(n, 64), 'bad name ');
    assertFields(
      await api.call('POST', '/api/v1/jobs', {
        body: jobBody('edges-many', { target: { url: 'http://127.0.0.1:9/', headers } }),
      }),
      expected('target.headers.bad name '),
      `header names, ${n}`,
    );
    const query = Object.keys(unknown(n, 'k'))
      .map((key) => `${key}=1`)
      .join('&');
    for (const list of ['/api/v1/jobs', `/api/v1/jobs/${jobId}/runs`, '/api/v1/dead-letters']) {
      assertFields(await api.call('GET', `${list}?${query}`), expected('k'), `${list}, ${n} unknown`);
    }
  }
  assert.equal(await tableState(api), before);
});

test('a key JavaScript gives a meaning to (__proto__, constructor.prototype) is a 400 naming where it is', async () => {
  // Refused before validation, as it must be, but answered "the body is not valid JSON", naming
  // `body`, for JSON that is valid: a webhook payload with such a key could not be told apart
  // from a syntax error.
  const raw = (target: string) => `{"name":"edges-proto","schedule":"* * * * *","target":${target}}`;
  const cases = [
    [raw('{"url":"http://127.0.0.1:9/","body":{"__proto__":{"admin":true}}}'), 'target.body.__proto__'],
    [raw('{"url":"http://127.0.0.1:9/","body":[1,{"a":{"__proto__":1}}]}'), 'target.body.1.a.__proto__'],
    [raw('{"url":"http://127.0.0.1:9/","headers":{"__proto__":"x"}}'), 'target.headers.__proto__'],
    [
      raw('{"url":"http://127.0.0.1:9/","body":{"constructor":{"prototype":{}}}}'),
      'target.body.constructor.prototype',
    ],
    ['{"__proto__":{"admin":true}}', '__proto__'],
  ] as const;
  const before = await tableState(api);
  for (const [body, field] of cases) {
    const response = await api.call('POST', '/api/v1/jobs', { raw: body });
    assertFields(response, [field], body);
    assert.doesNotMatch(JSON.stringify(response.body), /not valid JSON/, body);
  }
  assertFields(await api.call('POST', '/api/v1/jobs', { raw: '{"a":' }), ['body'], 'a syntax error still');
  assert.equal(await tableState(api), before);
});

test('a backoffMultiplier finer than PostgreSQL keeps it (a real) is a 400 naming it, not stored rounded', async () => {
  // 1.23456789 was saved and shown as 1.2345679, 9.999999999 as 10: and `helios apply` of such a
  // file found the job changed every time, withdrawing its runs created ahead on each apply.
  const retry = (backoffMultiplier: number) => ({
    retry: { maxAttempts: 3, backoffMs: 1000, backoffMultiplier },
  });
  const before = await tableState(api);
  for (const multiplier of [1.23456789, 9.999999999, 3.14159265358979, 1.00000001]) {
    assertFields(
      await api.call('POST', '/api/v1/jobs', { body: jobBody('edges-real', retry(multiplier)) }),
      ['retry.backoffMultiplier'],
      `create ${multiplier}`,
    );
    assertFields(
      await api.call('PATCH', `/api/v1/jobs/${jobId}`, { body: retry(multiplier) }),
      ['retry.backoffMultiplier'],
      `patch ${multiplier}`,
    );
  }
  assert.equal(await tableState(api), before);
  for (const multiplier of [1, 1.1, 1.5, 2.5, 1.0000001, 7.123456, 3.1415927, 10]) {
    const created = await api.call('POST', '/api/v1/jobs', {
      body: jobBody(`edges-real-${String(multiplier).replace('.', '-')}`, retry(multiplier)),
    });
    assert.equal(created.status, 201, `${multiplier}: ${created.text}`);
    const id = (created.body as { id: string }).id;
    const read = (await api.call('GET', `/api/v1/jobs/${id}`)).body as {
      retry: { backoffMultiplier: number };
    };
    assert.equal(read.retry.backoffMultiplier, multiplier);
  }
});

test('a JSON number with more digits than a double keeps is a 400 naming it, not stored changed', async () => {
  // JSON.parse rounds to the nearest double: a 64-bit id in a webhook payload was stored (and
  // sent) as another number, and timeoutMs 100.0000000000000001 passed as the integer 100.
  const raw = (fields: string) =>
    `{"name":"edges-digits","schedule":"* * * * *","target":{"url":"http://127.0.0.1:9/"${fields}}}`;
  const cases = [
    [raw(',"body":{"id":12345678901234567890}'), 'target.body.id'],
    [raw(',"body":[1,0.1000000000000000055511151231257827]'), 'target.body.1'],
    [raw(',"body":9007199254740993'), 'target.body'],
    [
      '{"name":"edges-digits","schedule":"* * * * *","target":{"url":"http://127.0.0.1:9/"},"timeoutMs":100.0000000000000001}',
      'timeoutMs',
    ],
  ] as const;
  const before = await tableState(api);
  for (const [body, field] of cases) {
    assertFields(await api.call('POST', '/api/v1/jobs', { raw: body }), [field], body);
  }
  assertFields(
    await api.call('PATCH', `/api/v1/jobs/${jobId}`, {
      raw: '{"target":{"url":"http://127.0.0.1:9/","body":{"id":-98765432109876543210}}}',
    }),
    ['target.body.id'],
    'patch',
  );
  assert.equal(await tableState(api), before);
  // Numbers a double keeps, however they are written, are stored.
  const kept = '[9007199254740991,1.0,1e2,100.000000000000000000,0.1,123456789012345.6,2.5e-300]';
  const created = await api.call('POST', '/api/v1/jobs', { raw: raw(`,"body":${kept}`) });
  assert.equal(created.status, 201, created.text);
  assert.deepEqual((created.body as { target: { body: unknown } }).target.body, JSON.parse(kept));
});
