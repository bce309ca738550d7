import assert from 'node:assert/strict';
import { test } from 'node:test';
import { loadConfig } from '../../src/config.js';
import { ConfigError } from '../../src/errors.js';

const BASE = {
  HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1:5432/db',
  HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379',
  HELIOS_KAFKA_BROKERS: '127.0.0.1:9092',
};

test('execution settings have documented defaults', () => {
  const config = loadConfig(BASE);
  assert.deepEqual(
    {
      workerPrefetch: config.workerPrefetch,
      claimGraceMs: config.claimGraceMs,
      clockSkewToleranceMs: config.clockSkewToleranceMs,
      claimLeadMs: config.claimLeadMs,
      pollIntervalMs: config.pollIntervalMs,
      pollOverdueMs: config.pollOverdueMs,
      claimCheckIntervalMs: config.claimCheckIntervalMs,
      reaperIntervalMs: config.reaperIntervalMs,
      responseExcerptBytes: config.responseExcerptBytes,
    },
    {
      workerPrefetch: 5000,
      claimGraceMs: 5000,
      clockSkewToleranceMs: 10,
      claimLeadMs: 50,
      pollIntervalMs: 1000,
      pollOverdueMs: 2000,
      claimCheckIntervalMs: 1000,
      reaperIntervalMs: 1000,
      responseExcerptBytes: 2048,
    },
  );
});

test('execution settings are parsed and bounded', () => {
  const config = loadConfig({ ...BASE, HELIOS_CLAIM_GRACE_MS: '1500', HELIOS_POLL_OVERDUE_MS: '0' });
  assert.equal(config.claimGraceMs, 1500);
  assert.equal(config.pollOverdueMs, 0);
  for (const [name, value] of [
    ['HELIOS_CLAIM_GRACE_MS', '50'],
    ['HELIOS_POLL_INTERVAL_MS', '0'],
    ['HELIOS_WORKER_PREFETCH', '0'],
    ['HELIOS_RESPONSE_EXCERPT_BYTES', '2MB'],
    ['HELIOS_CLAIM_LEAD_MS', '-1'],
  ] as const) {
    assert.throws(
      () => loadConfig({ ...BASE, [name]: value }),
      (err: unknown) => err instanceof ConfigError && err.variable === name,
      name,
    );
  }
});
