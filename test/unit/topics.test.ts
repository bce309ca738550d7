import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import { nodeTopics } from '../../src/broker/topics.js';
import { loadConfig } from '../../src/config/index.js';
import { REPO_ROOT } from '../support/env.js';

test('HELIOS_KAFKA_PARTITIONS sizes the runs topic only; the dead-letter topic gets one, and the README says so', () => {
  const { kafka } = loadConfig({
    HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1:5432/db',
    HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379',
    HELIOS_KAFKA_BROKERS: '127.0.0.1:9092',
    HELIOS_KAFKA_PARTITIONS: '12',
    HELIOS_KAFKA_REPLICATION_FACTOR: '3',
  });
  assert.deepEqual(nodeTopics(kafka), [
    { name: 'helios.runs', partitions: 12, replicationFactor: 3 },
    { name: 'helios.runs.dlq', partitions: 1, replicationFactor: 3 },
  ]);
  const readme = readFileSync(join(REPO_ROOT, 'README.md'), 'utf8');
  const row = readme.split('\n').find((line) => line.startsWith('| `HELIOS_KAFKA_PARTITIONS` |'));
  assert.ok(row, 'the README has a row for HELIOS_KAFKA_PARTITIONS');
  assert.match(row, /runs topic/);
  assert.match(row, /dead-letter topic always gets 1/);
});
