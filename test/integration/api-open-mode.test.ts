import assert from 'node:assert/strict';
import { request as httpRequest } from 'node:http';
import { after, before, test } from 'node:test';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';

// The API without tokens (open mode) on a real database: what a browser page on another origin,
// or one that rebinds its name to 127.0.0.1, can make it do. node:http rather than fetch, because
// fetch will not send a Host header of our choosing.

let api: TestApi;
let jobId: string;
before(async () => {
  api = await startTestApi();
  const created = await api.call('POST', '/api/v1/jobs', {
    body: jobBody('open-mode', { schedule: '0 0 1 1 *' }),
  });
  assert.equal(created.status, 201, created.text);
  jobId = (created.body as { id: string }).id;
});
after(() => api.close());

function raw(
  method: string,
  path: string,
  headers: Record<string, string>,
  body?: string,
): Promise<{ status: number; text: string }> {
  const url = new URL(api.url);
  return new Promise((resolve, reject) => {
    const req = httpRequest(
      { host: url.hostname, port: url.port, method, path, headers: { host: url.host, ...headers } },
      (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (chunk: string) => (text += chunk));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, text }));
      },
    );
    req.on('error', reject);
    req.end(body);
  });
}

/** Everything a write could have changed. */
async function snapshot(): Promise<string> {
  const jobs = await api.db.pool.query('SELECT * FROM jobs ORDER BY id');
  const runs = await api.db.pool.query('SELECT * FROM runs ORDER BY id');
  const outbox = await api.db.pool.query('SELECT count(*)::int AS n FROM outbox');
  return JSON.stringify([jobs.rows, runs.rows, outbox.rows]);
}

const json = { 'content-type': 'application/json' };
const newJob = (name: string) => JSON.stringify(jobBody(name));

test('a foreign Host (DNS rebinding) is refused for reads and writes; nothing changes', async () => {
  const before = await snapshot();
  for (const host of ['evil.example', 'evil.example:8080', '10.0.0.1', 'localhost.evil.example']) {
    assert.equal((await raw('GET', '/api/v1/jobs', { host })).status, 403, host);
    assert.equal((await raw('GET', '/openapi.json', { host })).status, 403, host);
    assert.equal((await raw('POST', `/api/v1/jobs/${jobId}/trigger`, { host, ...json }, '{}')).status, 403);
    assert.equal((await raw('POST', '/api/v1/jobs', { host, ...json }, newJob('rebound'))).status, 403);
  }
  assert.equal(await snapshot(), before);
  // Health stays reachable for probers that use a name.
  assert.equal((await raw('GET', '/healthz', { host: 'probe.internal' })).status, 200);
});

test('a request from a foreign Origin, or marked cross-site, is refused; nothing changes', async () => {
  const before = await snapshot();
  const foreign: Record<string, string>[] = [
    { origin: 'http://evil.example' },
    { origin: 'null' },
    { 'sec-fetch-site': 'cross-site' },
  ];
  for (const headers of foreign) {
    assert.equal((await raw('POST', '/api/v1/jobs', { ...headers, ...json }, newJob('cross'))).status, 403);
    assert.equal(
      (await raw('POST', `/api/v1/jobs/${jobId}/pause`, { ...headers, ...json }, '{}')).status,
      403,
    );
    assert.equal((await raw('GET', '/api/v1/jobs', headers)).status, 403);
  }
  assert.equal(await snapshot(), before);
});

test('simple cross-site writes (form-encoded, text/plain, bodiless) are refused; nothing changes', async () => {
  const before = await snapshot();
  const form = { 'content-type': 'application/x-www-form-urlencoded' };
  const text = { 'content-type': 'text/plain' };
  const multipart = { 'content-type': 'multipart/form-data; boundary=x' };
  for (const [path, headers, body] of [
    [`/api/v1/jobs/${jobId}/trigger`, {}, undefined],
    [`/api/v1/jobs/${jobId}/pause`, {}, undefined],
    [`/api/v1/jobs/${jobId}/pause`, form, 'a=1'],
    [`/api/v1/jobs/${jobId}/trigger`, text, newJob('x')],
    ['/api/v1/jobs', text, newJob('as-text')],
    ['/api/v1/jobs', form, 'name=x'],
    ['/api/v1/jobs', multipart, '--x--'],
  ] as const) {
    const answer = await raw('POST', path, headers, body);
    assert.ok(answer.status === 403, `${path} ${JSON.stringify(headers)}: ${answer.status} ${answer.text}`);
  }
  assert.equal((await raw('DELETE', `/api/v1/jobs/${jobId}`, {})).status, 403);
  assert.equal(await snapshot(), before);
});

test('same-origin JSON writes and bodiless writes with x-helios-client still work', async () => {
  const origin = api.url;
  const created = await raw('POST', '/api/v1/jobs', { origin, ...json }, newJob('same-origin'));
  assert.equal(created.status, 201, created.text);
  assert.equal(
    (await raw('POST', `/api/v1/jobs/${jobId}/trigger`, { 'x-helios-client': 'cli' })).status,
    202,
  );
  const localhost = `localhost:${new URL(api.url).port}`;
  assert.equal((await raw('GET', '/api/v1/jobs', { host: localhost })).status, 200);
});
