import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { after, before, test } from 'node:test';
import { createLogger } from '../../src/observability/logger.js';
import { sensitiveHeaderSet } from '../../src/security/sensitive-headers.js';
import { uniqueId } from '../support/env.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';

let api: TestApi;
before(async () => {
  api = await startTestApi({ sensitiveHeaders: ['X-Vault-Token'] });
});
after(() => api.close());

const tag = uniqueId();
const secrets = {
  Authorization: `Bearer auth-secret-${tag}`,
  cookie: `session=cookie-secret-${tag}`,
  'Proxy-Authorization': `Basic proxy-secret-${tag}`,
  'x-api-key': `apikey-secret-${tag}`,
  'X-Vault-Token': `vault-secret-${tag}`,
};
const plain = { 'X-Trace': `visible-${tag}` };
const target = {
  url: 'http://127.0.0.1:9/hook',
  method: 'POST',
  headers: { ...secrets, ...plain },
  body: { a: 1 },
};

/** Every response text of this test, checked at the end. */
const seen: string[] = [];
async function call(method: string, path: string, body?: unknown) {
  const response = await api.call(method, path, { body });
  seen.push(response.text);
  return response;
}

function assertNoSecret(text: string, where: string) {
  for (const value of Object.values(secrets)) {
    assert.ok(!text.includes(value), `${where} shows a secret header value`);
    // Not even the distinctive part of it.
    assert.ok(!text.includes(value.split(' ').at(-1)!), `${where} shows part of a secret`);
  }
}

test('sensitive header values are stored but every response shows "***"', async () => {
  const created = await call('POST', '/api/v1/jobs', jobBody('secretive', { target }));
  assert.equal(created.status, 201);
  const job = created.body as { id: string; target: { headers: Record<string, string> } };
  assert.deepEqual(job.target.headers, {
    Authorization: '***',
    cookie: '***',
    'Proxy-Authorization': '***',
    'x-api-key': '***',
    'X-Vault-Token': '***',
    ...plain,
  });
  const stored = await api.db.pool.query('SELECT target FROM jobs WHERE id = $1', [job.id]);
  assert.deepEqual(stored.rows[0].target.headers, target.headers, 'the real values are what gets sent');

  await call('GET', `/api/v1/jobs/${job.id}`);
  await call('GET', '/api/v1/jobs');
  await call('POST', `/api/v1/jobs/${job.id}/pause`);
  await call('POST', `/api/v1/jobs/${job.id}/resume`);
  const triggered = await call('POST', `/api/v1/jobs/${job.id}/trigger`);
  await call('GET', `/api/v1/jobs/${job.id}/runs`);
  await call('GET', `/api/v1/runs/${(triggered.body as { runId: string }).runId}`);

  // Sending "***" back keeps the stored value (a GET → edit → PATCH round trip is safe).
  const roundTrip = await call('PATCH', `/api/v1/jobs/${job.id}`, { target: job.target });
  assert.equal(roundTrip.status, 200);
  const kept = await api.db.pool.query('SELECT target FROM jobs WHERE id = $1', [job.id]);
  assert.deepEqual(kept.rows[0].target.headers, target.headers);

  // Error paths that carry the secrets in the request.
  assert.equal((await call('POST', '/api/v1/jobs', jobBody('secretive', { target }))).status, 409);
  assert.equal(
    (await call('POST', '/api/v1/jobs', jobBody('bad-zone', { target, timezone: 'X/Y' }))).status,
    400,
  );
  assert.equal(
    (
      await call(
        'POST',
        '/api/v1/jobs',
        jobBody('bad-header', { target: { ...target, headers: { ...secrets, 'Bad Name': 'x' } } }),
      )
    ).status,
    400,
  );
  assert.equal((await call('PATCH', `/api/v1/jobs/${job.id}`, { target, schedule: 'nope' })).status, 400);

  for (const [index, text] of seen.entries()) assertNoSecret(text, `response ${index}`);
  assert.ok(
    seen.some((t) => t.includes(plain['X-Trace'])),
    'plain headers are shown',
  );
});

test('no log line of the API server contains a sensitive header value', () => {
  assert.ok(api.logs.length > 0);
  for (const [index, line] of api.logs.entries()) assertNoSecret(line, `log line ${index}`);
});

test('a target logged whole has its sensitive headers redacted, whatever their case', () => {
  const lines: string[] = [];
  const destination = new Writable({
    write(chunk: Buffer, _encoding, done) {
      lines.push(chunk.toString());
      done();
    },
  });
  const logger = createLogger({
    level: 'info',
    nodeId: 'secrets',
    destination,
    sensitiveHeaders: sensitiveHeaderSet(['x-vault-token']),
  });
  logger.info({ target, req: { headers: { authorization: secrets.Authorization } } }, 'calling');
  const text = lines.join('');
  assertNoSecret(text, 'the log line');
  assert.match(text, /visible-/);
});
