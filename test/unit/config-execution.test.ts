import assert from 'node:assert/strict';
import { test } from 'node:test';
import { ConfigError, loadConfig } from '../../src/config/index.js';

const BASE = {
  HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1:5432/db',
  HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379',
  HELIOS_KAFKA_BROKERS: '127.0.0.1:9092',
};

test('the worker and leader sections have documented defaults', () => {
  const config = loadConfig(BASE);
  assert.deepEqual(config.worker, {
    concurrency: 64,
    prefetch: 5000,
    claimGraceMs: 5000,
    skewToleranceMs: 10,
    claimLeadMs: 750,
    misfireThresholdMs: 5000,
    pollIntervalMs: 1000,
    pollOverdueMs: 2000,
    claimCheckIntervalMs: 1000,
    maxExcerptBytes: 2048,
    completionHoldMs: 2000,
    dbConnections: 15,
  });
  assert.deepEqual(config.leader, {
    leaseTtlMs: 3000,
    safetyMarginMs: 500,
    lookaheadMs: 5500,
    misfireThresholdMs: 5000,
    batchSize: 500,
    poolSize: 5,
    reaperIntervalMs: 1000,
    stallMs: 4000,
    signalsIntervalMs: 5000,
    retention: { runsMs: 30 * 86_400_000, keepPerJob: 100, outboxMs: 600_000 },
  });
});

test('execution settings are parsed and bounded', () => {
  const config = loadConfig({ ...BASE, HELIOS_CLAIM_GRACE_MS: '1500', HELIOS_POLL_OVERDUE_MS: '0' });
  assert.equal(config.worker.claimGraceMs, 1500);
  assert.equal(config.worker.pollOverdueMs, 0);
  for (const [name, value] of [
    ['HELIOS_CLAIM_GRACE_MS', '50'],
    ['HELIOS_POLL_INTERVAL_MS', '0'],
    ['HELIOS_WORKER_PREFETCH', '0'],
    ['HELIOS_RESPONSE_EXCERPT_BYTES', '2MB'],
    ['HELIOS_CLAIM_LEAD_MS', '-1'],
    ['HELIOS_LEADER_STALL_MS', '500'],
  ] as const) {
    assert.throws(
      () => loadConfig({ ...BASE, [name]: value }),
      (err: unknown) => err instanceof ConfigError && err.variable === name,
      name,
    );
  }
});
