import assert from 'node:assert/strict';
import { createServer, type AddressInfo } from 'node:net';
import { after, before, test } from 'node:test';
import type { ApiRole } from '../../src/config/index.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { uniqueId } from '../support/env.js';
import { spawnNode, type ManagedProcess } from '../support/processes.js';
import { ADMIN, jobBody, startTestApi, VIEWER, type TestApi } from '../support/api.js';

const tokens = new Map<string, ApiRole>([
  [ADMIN, 'admin'],
  [VIEWER, 'viewer'],
]);
let api: TestApi;
let jobId: string;
let db: TestDatabase;
const nodes: ManagedProcess[] = [];

before(async () => {
  db = await createTestDatabase();
  api = await startTestApi({ tokens, db });
  const created = await api.call('POST', '/api/v1/jobs', { body: jobBody('auth-job'), token: ADMIN });
  jobId = (created.body as { id: string }).id;
});
after(async () => {
  await Promise.allSettled(nodes.map((n) => n.stop()));
  await api.close();
  await db.drop();
});

const reads = (): [string, string][] => [
  ['GET', '/api/v1/jobs'],
  ['GET', `/api/v1/jobs/${jobId}`],
  ['GET', `/api/v1/jobs/${jobId}/runs`],
  ['GET', '/api/v1/runs/00000000-0000-4000-8000-000000000000'],
  ['GET', '/api/v1/dead-letters'],
  ['GET', '/api/v1/cluster'],
];
const writes = (): [string, string, unknown?][] => [
  ['POST', '/api/v1/jobs', jobBody('auth-created')],
  ['PATCH', `/api/v1/jobs/${jobId}`, { timeoutMs: 1000 }],
  ['POST', `/api/v1/jobs/${jobId}/trigger`],
  ['POST', `/api/v1/jobs/${jobId}/pause`],
  ['POST', `/api/v1/jobs/${jobId}/resume`],
  ['POST', '/api/v1/dead-letters/00000000-0000-4000-8000-000000000000/replay'],
  ['DELETE', '/api/v1/jobs/auth-created'],
];

test('without a valid bearer token every API route answers 401 with a problem', async () => {
  const headerVariants: (Record<string, string> | undefined)[] = [
    undefined,
    { authorization: 'Bearer wrong-token-0123456789' },
    { authorization: `Basic ${Buffer.from(`x:${ADMIN}`).toString('base64')}` },
    { authorization: 'Bearer' },
    { authorization: `Bearer ${ADMIN}x` },
    { authorization: `Bearer ${ADMIN.slice(0, -1)}` },
  ];
  for (const [method, path, body] of [...reads(), ...writes()]) {
    for (const headers of headerVariants) {
      const response = await api.call(method, path, { body, headers });
      assert.equal(response.status, 401, `${method} ${path} ${JSON.stringify(headers)}`);
      assert.match(response.headers.get('content-type') ?? '', /problem\+json/);
      assert.match(response.headers.get('www-authenticate') ?? '', /^Bearer/);
    }
  }
  assert.equal((await api.call('GET', '/api/v1/no-such-route')).status, 401);
});

test('a viewer reads everything and writes nothing (403)', async () => {
  for (const [method, path] of reads()) {
    const response = await api.call(method, path, { token: VIEWER });
    assert.ok([200, 404].includes(response.status), `${method} ${path}: ${response.status}`);
    assert.notEqual(response.status, 401);
  }
  const before = await api.db.pool.query('SELECT count(*)::int AS n FROM jobs');
  for (const [method, path, body] of writes()) {
    const response = await api.call(method, path, { body, token: VIEWER });
    assert.equal(response.status, 403, `${method} ${path}`);
    assert.match(response.headers.get('content-type') ?? '', /problem\+json/);
  }
  const afterCount = await api.db.pool.query('SELECT count(*)::int AS n FROM jobs');
  assert.deepEqual(afterCount.rows, before.rows);
});

test('an admin may write', async () => {
  const expected = [201, 200, 202, 200, 200, 404, 204];
  for (const [index, [method, path, body]] of writes().entries()) {
    const response = await api.call(method, path, { body, token: ADMIN });
    assert.equal(response.status, expected[index], `${method} ${path}: ${JSON.stringify(response.body)}`);
  }
});

test('health stays open, metrics need a token unless HELIOS_METRICS_PUBLIC, docs are public', async () => {
  assert.equal((await api.call('GET', '/healthz')).status, 200);
  assert.equal((await api.call('GET', '/readyz')).status, 200);
  assert.equal((await api.call('GET', '/metrics')).status, 401);
  assert.equal((await api.call('GET', '/metrics', { token: VIEWER })).status, 200);
  assert.equal((await api.call('GET', '/openapi.json')).status, 200);
  assert.equal((await api.call('GET', '/docs')).status, 200);
  const open = await startTestApi({ tokens, db, metricsPublic: true });
  try {
    assert.equal((await open.call('GET', '/metrics')).status, 200);
    assert.equal((await open.call('GET', '/api/v1/jobs')).status, 401);
  } finally {
    await open.close();
  }
});

test('tokens never appear in a log line', () => {
  const joined = api.logs.join('\n');
  assert.ok(api.logs.length > 0);
  assert.ok(!joined.includes(ADMIN) && !joined.includes(VIEWER));
});

function nodeEnv(extra: Record<string, string>) {
  return {
    databaseUrl: db.url,
    etcdPrefix: `/helios-test/${uniqueId()}`,
    topic: `helios.test.${uniqueId()}`,
    extra,
  };
}

test('a node refuses to start on 0.0.0.0 without tokens, naming the variables', async () => {
  const node = spawnNode('auth-refuse', nodeEnv({ HELIOS_HTTP_HOST: '0.0.0.0' }));
  nodes.push(node);
  const exit = await node.exited;
  assert.equal(exit.code, 1);
  const stderr = node.stderr.join('\n');
  assert.match(stderr, /HELIOS_HTTP_HOST/);
  assert.match(stderr, /HELIOS_API_TOKENS/);
  assert.ok(!node.hasLog((l) => l.msg === 'node started'));
});

test('a node whose HTTP address cannot be bound exits 1 with one line naming the variable', async () => {
  const exitLine = async (name: string, extra: Record<string, string>) => {
    const node = spawnNode(name, nodeEnv(extra));
    nodes.push(node);
    const exit = await node.exited;
    assert.equal(exit.code, 1, node.stderr.join('\n'));
    const lines = node.stderr.join('\n').split('\n').filter(Boolean);
    assert.equal(lines.length, 1, `one line, no stack: ${lines.join('\n')}`);
    assert.ok(!node.hasLog((l) => l.msg === 'node started'));
    return lines[0]!;
  };
  const tokensEnv = { HELIOS_API_TOKENS: `${ADMIN}:admin` };
  assert.match(
    await exitLine('bind-host', { ...tokensEnv, HELIOS_HTTP_HOST: 'no-such-host.invalid' }),
    /^helios: HELIOS_HTTP_HOST: "no-such-host\.invalid" does not resolve/,
  );
  const taken = createServer();
  await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve));
  try {
    const { port } = taken.address() as AddressInfo;
    assert.match(
      await exitLine('bind-port', { HELIOS_HTTP_PORT: String(port) }),
      new RegExp(
        `^helios: HELIOS_HTTP_PORT: port ${port} is already in use on 127\\.0\\.0\\.1 \\(EADDRINUSE\\)$`,
      ),
    );
  } finally {
    taken.close();
  }
});

test('a node with tokens binds 0.0.0.0 and enforces them; without tokens it warns and stays on loopback', async () => {
  const node = spawnNode(
    'auth-bound',
    nodeEnv({ HELIOS_HTTP_HOST: '0.0.0.0', HELIOS_API_TOKENS: `${ADMIN}:admin,${VIEWER}:viewer` }),
  );
  nodes.push(node);
  const started = await node.waitForLog((l) => l.msg === 'node started', 30_000);
  const port = new URL(started.apiUrl as string).port;
  const base = `http://127.0.0.1:${port}/api/v1/jobs`;
  const post = (token?: string) =>
    fetch(base, {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...(token ? { authorization: `Bearer ${token}` } : {}) },
      body: JSON.stringify(jobBody(`node-${token ? token.slice(0, 5) : 'anon'}`)),
    });
  assert.equal((await post()).status, 401);
  assert.equal((await post(VIEWER)).status, 403);
  assert.equal((await post(ADMIN)).status, 201);
  assert.ok(!node.logs.some((l) => JSON.stringify(l).includes(ADMIN)));
  await node.stop();

  const open = spawnNode('auth-open', nodeEnv({}));
  nodes.push(open);
  const warned = await open.waitForLog((l) => /HELIOS_API_TOKENS is empty/.test(String(l.msg)), 30_000);
  assert.equal(warned.level, 40);
  const openStarted = await open.waitForLog((l) => l.msg === 'node started', 30_000);
  assert.match(String(openStarted.apiUrl), /^http:\/\/127\.0\.0\.1:/);
  await open.stop();
});
