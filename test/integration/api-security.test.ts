import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { ADMIN, jobBody, VIEWER } from '../support/api.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { REPO_ROOT, serverEnv, uniqueId } from '../support/env.js';
import { attemptsOf, insertJob, runsOf, TargetServer, waitFor } from '../support/execution.js';
import { ManagedProcess, nodeEnvironment, stopAll } from '../support/processes.js';

// A real node (dist/main.js node, with tokens) on the real servers, in its own mount namespace so
// that the test can change what a name resolves to for that node alone: its /etc/hosts is a
// bind-mounted copy the test rewrites (glibc reads /etc/hosts on every lookup).

const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const prefix = `/helios-test/${uniqueId()}`;
const topic = `helios.test.${uniqueId()}`;
const hostsFile = join(tmpdir(), `helios-hosts-${uniqueId()}`);
const REBIND = 'rebind.helios.test';
const baseHosts = readFileSync('/etc/hosts', 'utf8');
const pointName = (address: string) => writeFileSync(hostsFile, `${baseHosts}\n${address} ${REBIND}\n`);
const canUnshare = spawnSync('unshare', ['--mount', 'true']).status === 0;

const nodes: ManagedProcess[] = [];
const target = new TargetServer((request) =>
  request.path.startsWith('/issue') ? { status: 200, body: 'issued token tok-issued-7f3a' } : { status: 200 },
);
/** A server that must never be called: where a stolen secret would go. */
const thief = new TargetServer();
let db: TestDatabase;
let api = '';

before(async () => {
  db = await createTestDatabase();
  await target.start();
  await thief.start();
  pointName('192.0.2.1');
  const env = {
    ...nodeEnvironment('security-1', { databaseUrl: db.url, etcdPrefix: prefix, topic }),
    HELIOS_API_TOKENS: `${ADMIN}:admin,${VIEWER}:viewer`,
    // An operator's addition: the defaults (metadata addresses) must stay denied.
    HELIOS_TARGET_DENY: '10.0.0.0/8',
    HOSTS_FILE: hostsFile,
    NODE_BIN: process.execPath,
    MAIN_JS: `${REPO_ROOT}dist/main.js`,
  };
  const command = canUnshare
    ? [
        'unshare',
        ['--mount', 'sh', '-c', 'mount --bind "$HOSTS_FILE" /etc/hosts && exec "$NODE_BIN" "$MAIN_JS" node'],
      ]
    : [process.execPath, [`${REPO_ROOT}dist/main.js`, 'node']];
  const child = spawn(command[0] as string, command[1] as string[], {
    env,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const node = new ManagedProcess('security-1', child);
  nodes.push(node);
  const started = await node.waitForLog((l) => l.msg === 'node started', 30_000);
  api = String(started.apiUrl);
  await node.waitForLog((l) => l.msg === 'became leader', 30_000);
  await node.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
});
after(async () => {
  await db.pool.query('UPDATE jobs SET enabled = false').catch(() => undefined);
  await stopAll(nodes);
  await target.close();
  await thief.close();
  await db.drop();
  await etcd.delete().prefix(prefix);
  etcd.close();
  rmSync(hostsFile, { force: true });
});

async function call(method: string, path: string, options: { body?: unknown; token?: string | null } = {}) {
  const headers: Record<string, string> = {};
  const token = options.token === undefined ? ADMIN : options.token;
  if (token) headers.authorization = `Bearer ${token}`;
  if (options.body !== undefined) headers['content-type'] = 'application/json';
  const response = await fetch(`${api}/api/v1${path}`, {
    method,
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  const text = await response.text();
  return { status: response.status, text, body: (text ? JSON.parse(text) : null) as Record<string, unknown> };
}

const fields = (body: Record<string, unknown>) =>
  ((body.errors ?? []) as { field: string }[]).map((e) => e.field);

/** Everything a write could have changed, to compare before and after a refused request. */
async function snapshot(): Promise<string> {
  const jobs = await db.pool.query('SELECT * FROM jobs ORDER BY id');
  const runs = await db.pool.query('SELECT * FROM runs ORDER BY id');
  const outbox = await db.pool.query('SELECT count(*)::int AS n FROM outbox');
  return JSON.stringify([jobs.rows, runs.rows, outbox.rows]);
}

/** A job that never fires by itself (runs only when triggered). */
const quiet = (name: string, target: Record<string, unknown>, extra: Record<string, unknown> = {}) =>
  jobBody(name, { schedule: '0 0 1 1 *', target, ...extra });

async function finishedRun(runId: string) {
  return waitFor(`run ${runId} to finish`, async () => {
    const { rows } = await db.pool.query<{ state: string }>('SELECT state FROM runs WHERE id = $1', [runId]);
    const state = rows[0]?.state;
    return state === 'succeeded' || state === 'dead' ? state : null;
  });
}

test('a PATCH that sends "***" for a stored secret to a new origin is a 400 naming it; nothing is written or sent', async () => {
  const secret = `Bearer stolen-${uniqueId()}`;
  const created = await call('POST', '/jobs', {
    body: quiet('exfil', { url: `${target.url}/hook`, headers: { Authorization: secret } }),
  });
  assert.equal(created.status, 201, created.text);
  const id = String(created.body.id);
  const before = await snapshot();
  for (const url of [`${thief.url}/steal`, `${target.url.replace('http:', 'https:')}/hook`]) {
    const moved = await call('PATCH', `/jobs/${id}`, {
      body: { target: { url, headers: { Authorization: '***' } } },
    });
    assert.equal(moved.status, 400, moved.text);
    assert.deepEqual(fields(moved.body), ['target.headers.Authorization']);
    assert.ok(!moved.text.includes(secret));
  }
  assert.equal(await snapshot(), before, 'nothing was written');
  const triggered = await call('POST', `/jobs/${id}/trigger`);
  await finishedRun(String(triggered.body.runId));
  assert.equal(thief.requests.length, 0, 'nothing was sent to the new origin');
  assert.equal(
    target.forJob(id).at(-1)?.headers.authorization,
    secret,
    'the secret still goes where it was stored',
  );

  // The same origin keeps the secret; a new origin takes it only when it is sent again.
  const samePlace = await call('PATCH', `/jobs/${id}`, {
    body: { target: { url: `${target.url}/other?x=1`, headers: { Authorization: '***' } } },
  });
  assert.equal(samePlace.status, 200, samePlace.text);
  const resent = await call('PATCH', `/jobs/${id}`, {
    body: { target: { url: `${thief.url}/new-home`, headers: { Authorization: 'Bearer new-value' } } },
  });
  assert.equal(resent.status, 200, resent.text);
});

test("jobs aimed at the cluster's own etcd (its peer port too), Kafka, PostgreSQL and node API are refused at save time", async () => {
  const etcdPort = new URL(serverEnv().etcdEndpoints.split(',')[0]!).port;
  // Not configured anywhere: the node learns it from etcd's member list.
  const { members } = await etcd.cluster.memberList({});
  const peerPort = new URL(members[0]!.peerURLs[0]!).port;
  const kafkaPort = serverEnv().kafkaBrokers.split(',')[0]!.split(':').at(-1)!;
  const pgPort = new URL(serverEnv().databaseUrl).port;
  const apiPort = new URL(api).port;
  const before = await snapshot();
  for (const [what, port] of [
    ['etcd', etcdPort],
    ['etcd peer', peerPort],
    ['Kafka broker', kafkaPort],
    ['PostgreSQL', pgPort],
    ['node API', apiPort],
  ] as const) {
    for (const host of ['127.0.0.1', 'localhost', '127.0.0.2', '[::ffff:127.0.0.1]']) {
      const url = `http://${host}:${port}/v3/kv/put`;
      const refused = await call('POST', '/jobs', {
        body: quiet(`own-${uniqueId()}`, { url, method: 'POST' }),
      });
      assert.equal(refused.status, 400, `${url}: ${refused.text}`);
      assert.deepEqual(fields(refused.body), ['target.url'], url);
      assert.match(refused.text, new RegExp(`cluster's own ${what}`), url);
    }
  }
  assert.equal(await snapshot(), before, 'no job was stored');
});

test("a name that later resolves to the cluster's etcd is refused at execution, once, and etcd is untouched", async (t) => {
  if (!canUnshare) return t.skip('needs unshare --mount (root) to give the node its own /etc/hosts');
  const etcdPort = new URL(serverEnv().etcdEndpoints.split(',')[0]!).port;
  const key = `${prefix}/stolen-leader`;
  const b64 = (text: string) => Buffer.from(text).toString('base64');
  pointName('192.0.2.1');
  const attack = await call('POST', '/jobs', {
    body: quiet('rebind-etcd', {
      url: `http://${REBIND}:${etcdPort}/v3/kv/put`,
      method: 'POST',
      body: { key: b64(key), value: b64('no lease') },
    }),
  });
  assert.equal(attack.status, 201, `a harmless address at save time: ${attack.text}`);
  const control = await call('POST', '/jobs', {
    body: quiet('rebind-target', { url: `http://${REBIND}:${new URL(target.url).port}/ok` }),
  });
  assert.equal(control.status, 201, control.text);
  pointName('127.0.0.1');

  const controlRun = String((await call('POST', `/jobs/${String(control.body.id)}/trigger`)).body.runId);
  assert.equal(await finishedRun(controlRun), 'succeeded', 'the name does resolve to loopback for the node');
  const attackId = String(attack.body.id);
  const attackRun = String((await call('POST', `/jobs/${attackId}/trigger`)).body.runId);
  assert.equal(await finishedRun(attackRun), 'dead');
  const attempts = await attemptsOf(db.pool, attackRun);
  assert.equal(attempts.length, 1, 'a refused target is not retried');
  assert.match(attempts[0]!.error ?? '', /cluster's own etcd/);
  assert.equal((await runsOf(db.pool, attackId))[0]?.attempt, 1);
  assert.equal(await etcd.get(key).string(), null, 'etcd was never written');
});

test('header values HTTP cannot carry and reserved headers are a 400 naming the header; nothing is stored', async () => {
  const before = await snapshot();
  for (const [name, value] of [
    ['X-Price', '5 €'],
    ['X-Bell', 'a\u0007b'],
    ['X-Escape', '\u001b[31m'],
    ['X-Del', 'a\u007f'],
    ['Expect', '100-continue'],
    ['Keep-Alive', 'timeout=5'],
    ['Transfer-Encoding', 'chunked'],
    ['Upgrade', 'websocket'],
    ['TE', 'trailers'],
    ['Host', 'example.com'],
    ['Content-Length', '3'],
    ['Connection', 'close'],
  ] as const) {
    const refused = await call('POST', '/jobs', {
      body: quiet(`hdr-${uniqueId()}`, { url: `${target.url}/ok`, headers: { [name]: value } }),
    });
    assert.equal(refused.status, 400, `${name}: ${refused.text}`);
    assert.deepEqual(fields(refused.body), [`target.headers.${name}`], name);
  }
  assert.equal(await snapshot(), before, 'no job was stored');
});

test('a stored job whose request HTTP cannot carry fails once and is dead, not retried', async () => {
  // Stored directly, as by a version of Helios before the save-time check.
  const jobId = await insertJob(db.pool, {
    name: `legacy-${uniqueId()}`,
    schedule: '0 0 1 1 *',
    target: { url: `${target.url}/ok`, headers: { 'X-Price': '5 €' } },
    nextRunAt: new Date('2099-01-01T00:00:00Z'),
    maxAttempts: 5,
    backoffMs: 100,
  });
  const runId = String((await call('POST', `/jobs/${jobId}/trigger`)).body.runId);
  assert.equal(await finishedRun(runId), 'dead');
  const attempts = await attemptsOf(db.pool, runId);
  assert.equal(attempts.length, 1, 'the same request would fail every attempt');
  assert.match(attempts[0]!.error ?? '', /target\.headers\.X-Price/);
  assert.equal(target.forJob(jobId).length, 0);
});

test('with HELIOS_TARGET_DENY set, metadata addresses and their IPv6 transition forms stay denied', async () => {
  const before = await snapshot();
  for (const url of [
    'http://169.254.169.254/latest/meta-data/',
    'http://168.63.129.16/machine',
    'http://10.1.2.3/', // the operator's addition
    'http://[64:ff9b::a9fe:a9fe]/', // NAT64
    'http://[2002:a9fe:a9fe::1]/', // 6to4
    'http://[::169.254.169.254]/', // IPv4-compatible
    'http://[::ffff:169.254.169.254]/', // IPv4-mapped
  ]) {
    const refused = await call('POST', '/jobs', { body: quiet(`deny-${uniqueId()}`, { url }) });
    assert.equal(refused.status, 400, `${url}: ${refused.text}`);
    assert.deepEqual(fields(refused.body), ['target.url'], url);
  }
  assert.equal(await snapshot(), before, 'no job was stored');
});

test('a viewer sees no response excerpt and no URL query string; an admin sees both', async () => {
  const query = `token=hook-secret-${uniqueId()}`;
  const created = await call('POST', '/jobs', {
    body: quiet('webhook', { url: `${target.url}/issue?${query}` }),
  });
  assert.equal(created.status, 201, created.text);
  const id = String(created.body.id);
  const runId = String((await call('POST', `/jobs/${id}/trigger`)).body.runId);
  assert.equal(await finishedRun(runId), 'succeeded');

  const reads = [`/jobs/${id}`, '/jobs', `/runs/${runId}`, `/jobs/${id}/runs`, '/dead-letters', '/cluster'];
  for (const path of reads) {
    const seen = await call('GET', path, { token: VIEWER });
    assert.equal(seen.status, 200, path);
    assert.ok(!seen.text.includes(query.split('=')[1]!), `${path} shows the query string to a viewer`);
    assert.ok(!seen.text.includes('tok-issued-7f3a'), `${path} shows the excerpt to a viewer`);
  }
  const job = (await call('GET', `/jobs/${id}`, { token: VIEWER })).body as { target: { url: string } };
  assert.equal(job.target.url, `${target.url}/issue?***`);
  const run = (await call('GET', `/runs/${runId}`, { token: VIEWER })).body as {
    attempts: { responseExcerpt: string | null }[];
  };
  assert.equal(run.attempts[0]?.responseExcerpt, '***');

  const asAdmin = await call('GET', `/runs/${runId}`);
  assert.ok(asAdmin.text.includes(query) && asAdmin.text.includes('tok-issued-7f3a'));
});

test('a viewer’s writes are 403 and a request without a valid token is 401; neither changes the database', async () => {
  const created = await call('POST', '/jobs', { body: quiet('guarded', { url: `${target.url}/ok` }) });
  const id = String(created.body.id);
  const before = await snapshot();
  const writes: [string, string, unknown?][] = [
    ['POST', '/jobs', quiet('by-viewer', { url: `${target.url}/ok` })],
    ['PATCH', `/jobs/${id}`, { schedule: '* * * * *' }],
    ['POST', `/jobs/${id}/trigger`],
    ['POST', `/jobs/${id}/pause`],
    ['DELETE', `/jobs/${id}`],
  ];
  for (const [method, path, body] of writes) {
    assert.equal((await call(method, path, { body, token: VIEWER })).status, 403, `${method} ${path}`);
    assert.equal((await call(method, path, { body, token: null })).status, 401, `${method} ${path}`);
    assert.equal((await call(method, path, { body, token: 'not-a-token-0123456789' })).status, 401);
  }
  assert.equal(await snapshot(), before, 'nothing changed');
});

test('a target URL is stored and shown in its parsed, normalised form', async () => {
  const port = new URL(target.url).port;
  const created = await call('POST', '/jobs', {
    body: quiet('normalised', { url: `HTTP://LocalHost:${port}/a b/../c?q=1 2` }),
  });
  assert.equal(created.status, 201, created.text);
  const expected = `http://localhost:${port}/c?q=1%202`;
  assert.equal((created.body.target as { url: string }).url, expected);
  const { rows } = await db.pool.query<{ url: string }>(
    `SELECT target->>'url' AS url FROM jobs WHERE id = $1`,
    [created.body.id],
  );
  assert.equal(rows[0]?.url, expected);
});
