import assert from 'node:assert/strict';
import { test } from 'node:test';
import { hostname } from 'node:os';
import { ConfigError, defaultNodeId, loadConfig } from '../../src/config/index.js';

const BASE = {
  HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1:5432/db',
  HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379',
  HELIOS_KAFKA_BROKERS: '127.0.0.1:9092',
};

function failsOn(env: Record<string, string>, variable: string, pattern?: RegExp) {
  assert.throws(
    () => loadConfig({ ...BASE, ...env }),
    (err: unknown) => {
      assert.ok(err instanceof ConfigError, `expected ConfigError, got ${String(err)}`);
      assert.equal(err.variable, variable);
      assert.ok(err.message.startsWith(`${variable}:`), err.message);
      if (pattern) assert.match(err.message, pattern);
      return true;
    },
  );
}

test('defaults are applied and the result is frozen', () => {
  const config = loadConfig({ ...BASE, HELIOS_NODE_ID: 'n1' });
  assert.equal(config.node.id, 'n1');
  assert.deepEqual([...config.node.roles].sort(), ['api', 'scheduler', 'worker']);
  assert.equal(config.leader.leaseTtlMs, 3000);
  assert.equal(config.api.host, '127.0.0.1');
  assert.equal(config.api.port, 8080);
  assert.equal(config.worker.concurrency, 64);
  assert.equal(config.kafka.runsTopic, 'helios.runs');
  assert.equal(config.kafka.deadLetterTopic, 'helios.runs.dlq');
  assert.deepEqual(config.etcd.endpoints, ['http://127.0.0.1:2379']);
  assert.ok(Object.isFrozen(config));
  for (const [name, section] of Object.entries(config)) assert.ok(Object.isFrozen(section), name);
});

test('lists and numbers are parsed', () => {
  const config = loadConfig({
    ...BASE,
    HELIOS_ETCD_ENDPOINTS: 'http://a:1, http://b:2',
    HELIOS_KAFKA_BROKERS: 'k1:9092,k2:9093',
    HELIOS_ROLES: 'worker',
    HELIOS_LEASE_TTL_MS: '5000',
    HELIOS_API_TOKENS: 'aaaaaaaaaaaaaaaa:admin,bbbbbbbbbbbbbbbb:viewer',
  });
  assert.deepEqual(config.etcd.endpoints, ['http://a:1', 'http://b:2']);
  assert.deepEqual(config.kafka.brokers, ['k1:9092', 'k2:9093']);
  assert.deepEqual([...config.node.roles], ['worker']);
  assert.equal(config.leader.leaseTtlMs, 5000);
  assert.equal(config.api.tokens.get('bbbbbbbbbbbbbbbb'), 'viewer');
});

test('missing required variables are named', () => {
  assert.throws(() => loadConfig({}), /HELIOS_DATABASE_URL: is required/);
  failsOn({ HELIOS_ETCD_ENDPOINTS: '' }, 'HELIOS_ETCD_ENDPOINTS', /required/);
});

test('bad values give an error naming the variable', () => {
  failsOn({ HELIOS_DATABASE_URL: 'mysql://x/y' }, 'HELIOS_DATABASE_URL', /protocol/);
  failsOn({ HELIOS_ETCD_ENDPOINTS: 'not a url' }, 'HELIOS_ETCD_ENDPOINTS', /not a URL/);
  failsOn({ HELIOS_KAFKA_BROKERS: 'localhost' }, 'HELIOS_KAFKA_BROKERS', /host:port/);
  failsOn({ HELIOS_HTTP_PORT: 'eighty' }, 'HELIOS_HTTP_PORT', /integer/);
  failsOn({ HELIOS_HTTP_PORT: '70000' }, 'HELIOS_HTTP_PORT', /between/);
  failsOn({ HELIOS_LEASE_TTL_MS: '500' }, 'HELIOS_LEASE_TTL_MS', /between/);
  failsOn({ HELIOS_ROLES: 'scheduler,cook' }, 'HELIOS_ROLES', /cook/);
  failsOn({ HELIOS_NODE_ID: 'has space' }, 'HELIOS_NODE_ID');
  failsOn({ HELIOS_WORKER_CONCURRENCY: '0' }, 'HELIOS_WORKER_CONCURRENCY');
  failsOn({ HELIOS_LOG_LEVEL: 'loud' }, 'HELIOS_LOG_LEVEL');
  failsOn({ HELIOS_LEADER_SAFETY_MARGIN_MS: '2000' }, 'HELIOS_LEADER_SAFETY_MARGIN_MS');
});

test("Kafka topic names follow Kafka's topic rules, the two topics differ, a group id is any printable id", () => {
  const ok = loadConfig({
    ...BASE,
    HELIOS_KAFKA_TOPIC: 'Team_A.runs-1',
    HELIOS_KAFKA_DLQ_TOPIC: 'x'.repeat(249),
    HELIOS_KAFKA_GROUP: 'team-a.workers',
  });
  assert.equal(ok.kafka.runsTopic, 'Team_A.runs-1');
  assert.equal(ok.kafka.deadLetterTopic.length, 249);
  for (const variable of ['HELIOS_KAFKA_TOPIC', 'HELIOS_KAFKA_DLQ_TOPIC']) {
    for (const bad of ['.', '..', 'has space', 'runs/1', 'runs:1', 'ünïcode', 'x'.repeat(250)]) {
      failsOn({ [variable]: bad }, variable, /1-249 letters/);
    }
  }
  // Kafka takes any group id: only control characters and an over-long one are refused.
  assert.equal(
    loadConfig({ ...BASE, HELIOS_KAFKA_GROUP: 'team a/workers' }).kafka.consumerGroup,
    'team a/workers',
  );
  for (const bad of ['tab\there', 'x'.repeat(250)])
    failsOn({ HELIOS_KAFKA_GROUP: bad }, 'HELIOS_KAFKA_GROUP', /control/);
  failsOn({ HELIOS_KAFKA_TOPIC: 'jobs', HELIOS_KAFKA_DLQ_TOPIC: 'jobs' }, 'HELIOS_KAFKA_DLQ_TOPIC', /differ/);
  failsOn({ HELIOS_KAFKA_DLQ_TOPIC: 'helios_runs' }, 'HELIOS_KAFKA_DLQ_TOPIC', /HELIOS_KAFKA_TOPIC/);
});

test('Kafka brokers need a host and a port within 1-65535', () => {
  const config = loadConfig({ ...BASE, HELIOS_KAFKA_BROKERS: 'kafka-0.kafka:9092,10.0.0.1:1,[::1]:65535' });
  assert.deepEqual(config.kafka.brokers, ['kafka-0.kafka:9092', '10.0.0.1:1', '[::1]:65535']);
  failsOn({ HELIOS_KAFKA_BROKERS: 'k:0' }, 'HELIOS_KAFKA_BROKERS', /port must be between 1 and 65535: "k:0"/);
  failsOn({ HELIOS_KAFKA_BROKERS: 'k:1,k:65536' }, 'HELIOS_KAFKA_BROKERS', /65535: "k:65536"/);
  failsOn({ HELIOS_KAFKA_BROKERS: ':9092' }, 'HELIOS_KAFKA_BROKERS', /no host: ":9092"/);
  failsOn({ HELIOS_KAFKA_BROKERS: '[]:9092' }, 'HELIOS_KAFKA_BROKERS', /no host/);
  failsOn({ HELIOS_KAFKA_BROKERS: '::1:9092' }, 'HELIOS_KAFKA_BROKERS', /host:port/);
  failsOn({ HELIOS_KAFKA_BROKERS: 'k:' }, 'HELIOS_KAFKA_BROKERS', /host:port/);
});

test('the default node id is <hostname>-<pid>, kept within the rule for any hostname', () => {
  assert.equal(defaultNodeId('web-1', 42), 'web-1-42');
  assert.equal(loadConfig(BASE).node.id, defaultNodeId(hostname(), process.pid));
  const rule = /^[A-Za-z0-9._-]{1,64}$/;
  // Pods of one StatefulSet: 63-character names that differ only at the end, each process pid 1.
  const pod = (n: number) => `${'scheduler-'.repeat(6)}abc-${n}`;
  const ids = [pod(0), pod(1)].map((host) => defaultNodeId(host, 1));
  for (const id of ids) assert.match(id, rule);
  assert.notEqual(ids[0], ids[1]);
  const long = defaultNodeId('h'.repeat(253), 4_194_304);
  assert.match(long, rule);
  assert.equal(long.length, 64);
  assert.ok(long.startsWith('hhhh') && long.endsWith('-4194304'), long);
  assert.match(defaultNodeId('My Mac (2)', 7), /^My-Mac--2--[0-9a-f]{8}-7$/);
  assert.match(defaultNodeId('', 7), rule);
});

test('a bad API token entry is reported by position, never by value', () => {
  const secret = 'supersecretvalue-123';
  assert.throws(
    () => loadConfig({ ...BASE, HELIOS_API_TOKENS: `${secret}:root` }),
    (err: unknown) => {
      assert.ok(err instanceof ConfigError);
      assert.equal(err.variable, 'HELIOS_API_TOKENS');
      assert.match(err.message, /entry 1/);
      assert.ok(!err.message.includes(secret));
      return true;
    },
  );
  failsOn({ HELIOS_API_TOKENS: 'short:admin' }, 'HELIOS_API_TOKENS', /16 characters/);
});

test('a token given twice is refused by position, whatever its roles, never by value', () => {
  const secret = 'repeated-secret-0123';
  const other = 'other-secret-456789';
  for (const value of [
    `${secret}:admin,${secret}:viewer`,
    `${secret}:viewer,${other}:admin, ${secret} :viewer`,
  ]) {
    assert.throws(
      () => loadConfig({ ...BASE, HELIOS_API_TOKENS: value }),
      (err: unknown) => {
        assert.ok(err instanceof ConfigError);
        assert.equal(err.variable, 'HELIOS_API_TOKENS');
        assert.match(err.message, /entry (2|3) repeats the token of entry 1/);
        assert.ok(!err.message.includes(secret) && !err.message.includes(other), err.message);
        return true;
      },
    );
  }
});

test('retention settings take durations with units and reject anything else by name', () => {
  const base = {
    HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1/db',
    HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379',
    HELIOS_KAFKA_BROKERS: '127.0.0.1:9092',
  };
  assert.deepEqual(loadConfig(base).leader.retention, {
    runsMs: 30 * 86_400_000,
    keepPerJob: 100,
    outboxMs: 600_000,
  });
  const set = loadConfig({
    ...base,
    HELIOS_RUN_RETENTION: '2m',
    HELIOS_OUTBOX_RETENTION: '90s',
    HELIOS_RUN_KEEP_PER_JOB: '5',
  });
  assert.deepEqual(set.leader.retention, { runsMs: 120_000, keepPerJob: 5, outboxMs: 90_000 });
  assert.equal(loadConfig({ ...base, HELIOS_RUN_RETENTION: '1500' }).leader.retention.runsMs, 1500);
  assert.throws(() => loadConfig({ ...base, HELIOS_RUN_RETENTION: '30 days' }), /HELIOS_RUN_RETENTION/);
  assert.throws(() => loadConfig({ ...base, HELIOS_RUN_RETENTION: '0' }), /HELIOS_RUN_RETENTION/);
});

test("the leader's pool and the worker's share of the node's pool: defaults and bounds", () => {
  const defaults = loadConfig(BASE);
  assert.equal(defaults.leader.poolSize, 5);
  assert.equal(defaults.worker.dbConnections, 15, 'three quarters of the default pool of 20');
  assert.equal(defaults.leader.signalsIntervalMs, 5000);
  assert.equal(loadConfig({ ...BASE, HELIOS_DATABASE_POOL_SIZE: '2' }).worker.dbConnections, 1);
  const set = loadConfig({
    ...BASE,
    HELIOS_DATABASE_POOL_SIZE: '10',
    HELIOS_WORKER_DB_CONNECTIONS: '9',
    HELIOS_LEADER_POOL_SIZE: '3',
    HELIOS_SIGNALS_INTERVAL_MS: '1000',
  });
  assert.deepEqual(
    [set.worker.dbConnections, set.leader.poolSize, set.leader.signalsIntervalMs],
    [9, 3, 1000],
  );
  // The share must leave the API at least one connection of the pool.
  failsOn(
    { HELIOS_DATABASE_POOL_SIZE: '10', HELIOS_WORKER_DB_CONNECTIONS: '10' },
    'HELIOS_WORKER_DB_CONNECTIONS',
  );
  failsOn({ HELIOS_LEADER_POOL_SIZE: '0' }, 'HELIOS_LEADER_POOL_SIZE');
  failsOn({ HELIOS_SIGNALS_INTERVAL_MS: 'soon' }, 'HELIOS_SIGNALS_INTERVAL_MS');
});

test('the cluster gauges are read at least once a minute, so that HeliosClusterGaugesStale (3 minutes) cannot fire on a healthy cluster', () => {
  assert.equal(loadConfig({ ...BASE, HELIOS_SIGNALS_INTERVAL_MS: '60000' }).leader.signalsIntervalMs, 60_000);
  failsOn({ HELIOS_SIGNALS_INTERVAL_MS: '60001' }, 'HELIOS_SIGNALS_INTERVAL_MS', /between 100 and 60000/);
});
