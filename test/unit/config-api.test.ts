import assert from 'node:assert/strict';
import { test } from 'node:test';
import { listenOn } from '../../src/api/server.js';
import { ConfigError, isLoopbackHost, loadCliConfig, loadConfig } from '../../src/config/index.js';
import { checkTargetUrl, deniedReason } from '../../src/security/target-policy.js';
import { endpointsOfDatabaseUrl } from '../../src/security/cluster-endpoints.js';

const BASE = {
  HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1:5432/db',
  HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379',
  HELIOS_KAFKA_BROKERS: '127.0.0.1:9092',
};
const TOKENS = { HELIOS_API_TOKENS: 'aaaaaaaaaaaaaaaa:admin' };

function failsOn(env: Record<string, string>, variable: string, pattern?: RegExp) {
  assert.throws(
    () => loadConfig({ ...BASE, ...env }),
    (err: unknown) => {
      assert.ok(err instanceof ConfigError, String(err));
      assert.equal(err.variable, variable);
      if (pattern) assert.match(err.message, pattern);
      return true;
    },
  );
}

test('API settings have safe defaults', () => {
  const config = loadConfig(BASE);
  assert.equal(config.api.metricsPublic, false);
  assert.equal(config.api.bodyLimit, 256 * 1024);
  assert.deepEqual([...config.targets.sensitiveHeaders].sort(), [
    'authorization',
    'cookie',
    'proxy-authorization',
    'x-api-key',
  ]);
  assert.ok(deniedReason('169.254.169.254', config.targets.policy));
  assert.ok(deniedReason('fe80::1', config.targets.policy));
  assert.equal(deniedReason('127.0.0.1', config.targets.policy), null);
});

test('API settings are parsed', () => {
  const config = loadConfig({
    ...BASE,
    HELIOS_METRICS_PUBLIC: 'true',
    HELIOS_API_BODY_LIMIT: '4096',
    HELIOS_SENSITIVE_HEADERS: 'X-Vault-Token, x-signature',
    HELIOS_TARGET_DENY: '10.0.0.0/8',
    HELIOS_TARGET_ALLOW: '10.0.0.0/8, 192.0.2.0/24',
  });
  assert.equal(config.api.metricsPublic, true);
  assert.equal(config.api.bodyLimit, 4096);
  assert.ok(config.targets.sensitiveHeaders.has('x-vault-token'));
  assert.ok(config.targets.sensitiveHeaders.has('authorization'), 'the built-in names stay');
  assert.ok(deniedReason('10.1.2.3', config.targets.policy), 'deny wins over allow');
  assert.equal(deniedReason('192.0.2.1', config.targets.policy), null);
  assert.ok(deniedReason('198.51.100.1', config.targets.policy), 'outside the allow list');
  assert.match(
    deniedReason('169.254.169.254', config.targets.policy) ?? '',
    /denied range 169\.254\.0\.0\/16/,
    'HELIOS_TARGET_DENY adds to the defaults: the metadata address stays denied',
  );
  const none = loadConfig({ ...BASE, HELIOS_TARGET_DENY: 'none' });
  assert.ok(deniedReason('169.254.169.254', none.targets.policy), '"none" adds nothing, removes nothing');
  const off = loadConfig({ ...BASE, HELIOS_TARGET_DENY_DEFAULTS: 'false' });
  assert.equal(
    deniedReason('169.254.169.254', off.targets.policy),
    null,
    'only an explicit setting drops them',
  );
});

test('HELIOS_TARGET_POLICY=strict also denies loopback and private ranges; permissive is the default', () => {
  const permissive = loadConfig(BASE);
  assert.equal(permissive.targets.mode, 'permissive');
  assert.equal(deniedReason('127.0.0.1', permissive.targets.policy, 3000), null);
  const strict = loadConfig({ ...BASE, HELIOS_TARGET_POLICY: 'strict' });
  for (const address of [
    '127.0.0.1',
    '::1',
    '10.1.2.3',
    '172.16.0.1',
    '192.168.1.1',
    'fd12::1',
    '100.64.0.1',
  ]) {
    assert.ok(deniedReason(address, strict.targets.policy), `${address} is denied in strict mode`);
  }
  assert.ok(deniedReason('169.254.169.254', strict.targets.policy));
  assert.equal(deniedReason('203.0.113.9', strict.targets.policy), null);
  failsOn({ HELIOS_TARGET_POLICY: 'lenient' }, 'HELIOS_TARGET_POLICY');
});

test("the configured etcd, Kafka and PostgreSQL endpoints and the node's API are denied on their ports", () => {
  const config = loadConfig({
    ...BASE,
    HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1:5433/db',
    HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379,http://10.0.0.7:2379',
    HELIOS_HTTP_PORT: '8181',
  });
  const policy = config.targets.policy;
  assert.match(deniedReason('127.0.0.1', policy, 2379) ?? '', /cluster's own etcd/);
  assert.match(deniedReason('127.0.0.1', policy, 9092) ?? '', /cluster's own Kafka broker/);
  assert.match(deniedReason('127.0.0.1', policy, 5433) ?? '', /cluster's own PostgreSQL/);
  assert.match(deniedReason('10.0.0.7', policy, 2379) ?? '', /cluster's own etcd/);
  assert.deepEqual(
    endpointsOfDatabaseUrl('postgres://u:p@db1:5433,[fd00::7]/x?sslmode=require').map((e) => [
      e.host,
      e.port,
    ]),
    [
      ['db1', 5433],
      ['fd00::7', 5432],
    ],
    'every host of a multi-host connection string',
  );
  // A password with an unencoded "@", which pg accepts (it reads the hosts after the last "@"):
  // the password's tail was taken for a host, and the database's own port was allowed.
  assert.deepEqual(
    endpointsOfDatabaseUrl('postgres://helios:pa@ss-w0rd@127.0.0.1:5432/helios').map((e) => [e.host, e.port]),
    [['127.0.0.1', 5432]],
  );
  const withAt = loadConfig({
    ...BASE,
    HELIOS_DATABASE_URL: 'postgres://helios:pa@ss@127.0.0.1:5432/helios',
  });
  assert.match(deniedReason('127.0.0.1', withAt.targets.policy, 5432) ?? '', /cluster's own PostgreSQL/);
  assert.match(deniedReason('127.0.0.1', policy, 8181) ?? '', /cluster's own node API/);
  // Loopback servers are reached through every loopback address and "this host".
  assert.ok(deniedReason('127.0.0.2', policy, 2379));
  assert.ok(deniedReason('::1', policy, 2379));
  assert.ok(deniedReason('::ffff:127.0.0.1', policy, 9092));
  // Other ports of the same host stay reachable in the permissive policy (local demo targets).
  assert.equal(deniedReason('127.0.0.1', policy, 2380), null);
  assert.equal(deniedReason('10.0.0.7', policy, 80), null);
});

test('a configured etcd endpoint without a port is refused on the port the etcd client dials (443)', () => {
  // etcd3 hands the endpoint to gRPC without its scheme, and gRPC's default port is 443 for
  // http:// and https:// alike: a node configured so reaches etcd (or a proxy in front of it) there.
  const config = loadConfig({ ...BASE, HELIOS_ETCD_ENDPOINTS: 'http://10.0.0.9,https://etcd.internal' });
  assert.match(deniedReason('10.0.0.9', config.targets.policy, 443) ?? '', /cluster's own etcd/);
  assert.match(
    checkTargetUrl('https://etcd.internal/v3/kv/put', config.targets.policy) ?? '',
    /cluster's own etcd/,
  );
});

test('the API rate limit defaults to 6000 per minute per token; 0 turns it off', () => {
  assert.deepEqual(loadConfig(BASE).api.rateLimit, { max: 6000, windowMs: 60_000 });
  const set = loadConfig({ ...BASE, HELIOS_API_RATE_LIMIT: '50', HELIOS_API_RATE_WINDOW_MS: '1000' });
  assert.deepEqual(set.api.rateLimit, { max: 50, windowMs: 1000 });
  assert.equal(loadConfig({ ...BASE, HELIOS_API_RATE_LIMIT: '0' }).api.rateLimit, null);
  failsOn({ HELIOS_API_RATE_LIMIT: 'lots' }, 'HELIOS_API_RATE_LIMIT');
});

test('bad API settings name their variable', () => {
  failsOn({ HELIOS_TARGET_DENY: '10.0.0.0/99' }, 'HELIOS_TARGET_DENY');
  failsOn({ HELIOS_TARGET_ALLOW: 'example.com' }, 'HELIOS_TARGET_ALLOW');
  failsOn({ HELIOS_METRICS_PUBLIC: 'maybe' }, 'HELIOS_METRICS_PUBLIC');
  failsOn({ HELIOS_API_BODY_LIMIT: '10' }, 'HELIOS_API_BODY_LIMIT');
  failsOn({ HELIOS_SENSITIVE_HEADERS: 'bad header' }, 'HELIOS_SENSITIVE_HEADERS');
});

test('without tokens only a loopback address may be bound', () => {
  for (const host of ['0.0.0.0', '::', '192.0.2.10', 'example.com']) {
    failsOn({ HELIOS_HTTP_HOST: host }, 'HELIOS_HTTP_HOST', /HELIOS_API_TOKENS/);
    assert.equal(loadConfig({ ...BASE, ...TOKENS, HELIOS_HTTP_HOST: host }).api.host, host);
  }
  for (const host of ['127.0.0.1', '127.1.2.3', '::1', '[::1]', 'localhost']) {
    assert.ok(isLoopbackHost(host), host);
    assert.equal(loadConfig({ ...BASE, HELIOS_HTTP_HOST: host }).api.host, host);
  }
});

test('the CLI reads HELIOS_API_URL and HELIOS_API_TOKEN', () => {
  assert.deepEqual(loadCliConfig({}), { apiUrl: 'http://127.0.0.1:8080', apiToken: undefined });
  assert.deepEqual(loadCliConfig({ HELIOS_API_URL: 'https://h.example/', HELIOS_API_TOKEN: 't' }), {
    apiUrl: 'https://h.example',
    apiToken: 't',
  });
  assert.throws(() => loadCliConfig({ HELIOS_API_URL: 'ftp://x' }), /HELIOS_API_URL/);
});

test('a bind refused for its address names HELIOS_HTTP_HOST or HELIOS_HTTP_PORT; other failures pass through', async () => {
  const failing = (code: string) => ({
    listen: async (): Promise<string> => {
      throw Object.assign(new Error(`listen ${code}`), { code });
    },
  });
  const address = { host: 'api.internal', port: 80 };
  const expected: [string, string, RegExp][] = [
    ['ENOTFOUND', 'HELIOS_HTTP_HOST', /"api\.internal" does not resolve \(ENOTFOUND\)/],
    ['EAI_AGAIN', 'HELIOS_HTTP_HOST', /does not resolve/],
    ['EADDRNOTAVAIL', 'HELIOS_HTTP_HOST', /not an address of this host/],
    ['EADDRINUSE', 'HELIOS_HTTP_PORT', /port 80 is already in use on api\.internal/],
    ['EACCES', 'HELIOS_HTTP_PORT', /binding port 80 on api\.internal is not permitted/],
  ];
  for (const [code, variable, message] of expected) {
    await assert.rejects(listenOn(failing(code), address), (err: unknown) => {
      assert.ok(err instanceof ConfigError, code);
      assert.equal(err.variable, variable);
      assert.match(err.message, message);
      assert.equal((err.cause as { code?: string }).code, code);
      return true;
    });
  }
  await assert.rejects(listenOn(failing('EMFILE'), address), /listen EMFILE/);
});
