// Contract item 11 for PostgreSQL, the one cluster server known only from configuration (etcd's
// members and Kafka's brokers are also learnt from the running servers). pg takes a server's host
// and port from the connection string's query (`?host=`, `?port=`, which win over the authority),
// then from PGHOST and PGPORT, then localhost:5432: the target policy must refuse the server pg
// really connects to, not the authority as written. An embedded node on the real servers runs on
// such a connection string here, so the address refused is the one its own pool uses.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import pg from 'pg';
import { loadConfig, startNode, type HeliosNode } from '../../src/index.js';
import { deniedReason } from '../../src/security/target-policy.js';
import { assertRefusedAtExecution } from '../support/refused-target.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { nodeEnvironment } from '../support/processes.js';

let fx: IntegrationFixture;
let node: HeliosNode;
/** The database as the fixture writes it: `postgres://user@127.0.0.1:<port>/<name>`. */
let written: URL;
/** The same database with host and port in the query, the authority naming a port nothing serves. */
let queryForm = '';

before(async () => {
  fx = await integrationFixture();
  written = new URL(fx.db.url);
  queryForm = `postgres://${written.username}@192.0.2.1:1${written.pathname}?host=${written.hostname}&port=${written.port}`;
  const config = loadConfig({
    ...nodeEnvironment('pg-url-1', fx.env()),
    HELIOS_DATABASE_URL: queryForm,
    HELIOS_LOG_LEVEL: 'warn',
  });
  node = await startNode({ config });
});
after(async () => {
  await node?.stop();
  await fx.teardown();
});

/** The port of the server a connection string reaches, asked of that server (pg reads PG* itself). */
async function serverPort(connectionString: string, env: Record<string, string> = {}): Promise<number> {
  const saved = Object.fromEntries(Object.keys(env).map((k) => [k, process.env[k]]));
  Object.assign(process.env, env);
  const client = new pg.Client({ connectionString });
  try {
    await client.connect();
    const { rows } = await client.query<{ port: number }>('SELECT inet_server_port() AS port');
    return rows[0]!.port;
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
    await client.end().catch(() => undefined);
  }
}

test('a node whose connection string names its server in the query refuses that server as a target, at save and at execution', async () => {
  const port = Number(written.port);
  assert.equal(await serverPort(queryForm), port, "the query's host and port are where pg connects");
  for (const host of ['127.0.0.1', 'localhost']) {
    const response = await fetch(`${node.apiUrl}/api/v1/jobs`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({
        name: `own-database-${host}`,
        schedule: '0 0 1 1 *',
        target: { url: `http://${host}:${port}/`, method: 'POST', body: { q: 'x' } },
      }),
    });
    const text = await response.text();
    assert.equal(response.status, 400, `${host}: ${text}`);
    assert.match(text, /target\.url/);
    assert.match(text, /cluster's own PostgreSQL/);
  }

  // A job stored without the API (or before this check): the worker refuses it, once.
  await assertRefusedAtExecution(fx.db.pool, node.apiUrl, {
    name: 'own-database-stored',
    url: `http://127.0.0.1:${port}/`,
    what: 'PostgreSQL',
  });
});

test('the port in the query, and PGHOST and PGPORT under a connection string without them, are refused too', async () => {
  const port = Number(written.port);
  const database = written.pathname.slice(1);
  const forms: { url: string; env: Record<string, string> }[] = [
    { url: `postgres://${written.username}@${written.hostname}:1/${database}?port=${port}`, env: {} },
    {
      url: `postgres:///${database}?user=${written.username}`,
      env: { PGHOST: written.hostname, PGPORT: String(port) },
    },
    {
      url: `postgresql://${written.username}@${written.hostname}/${database}`,
      env: { PGPORT: String(port) },
    },
  ];
  for (const { url, env } of forms) {
    assert.equal(await serverPort(url, env), port, `${url} with ${JSON.stringify(env)} reaches the server`);
    const config = loadConfig({ ...nodeEnvironment('pg-url-2', fx.env()), HELIOS_DATABASE_URL: url, ...env });
    for (const address of ['127.0.0.1', '::1']) {
      assert.match(
        deniedReason(address, config.targets.policy, port) ?? 'allowed',
        /cluster's own PostgreSQL/,
        `${address}:${port} under ${url} with ${JSON.stringify(env)}`,
      );
    }
  }
});
