import assert from 'node:assert/strict';
import { test } from 'node:test';
import { pino } from 'pino';
import { ClusterSignals } from '../../src/observability/cluster-signals.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { ClusterCounts } from '../../src/store/signals.js';

const counts: ClusterCounts = {
  outboxPending: 7,
  outboxOldestAgeSeconds: 3,
  runsQueued: 5,
  runsOverdue: 1,
  runsWaitingForbid: 0,
  runsRunning: 2,
  deadLettersOpen: 4,
};

async function gaugeValue(metric: {
  get(): Promise<{ values: { value: number }[] }>;
}): Promise<number | undefined> {
  return (await metric.get()).values[0]?.value;
}

test('the database gauges are set while the Kafka lag reading still waits (Kafka down)', async () => {
  const metrics = createMetrics('signals-test');
  let answerLag!: (lag: number) => void;
  const signals = new ClusterSignals({
    // Pure logic: the statement is store/signals.ts's, tested against PostgreSQL in metrics.test.ts.
    db: { query: async () => ({ rows: [counts] }) } as never,
    signal: new AbortController().signal,
    intervalMs: 5000,
    overdueMs: 5000,
    kafkaLag: () => new Promise<number>((resolve) => (answerLag = resolve)),
    logger: pino({ level: 'silent' }),
    metrics,
  });
  const reading = signals.refresh();
  let ended = false;
  void reading.then(() => (ended = true));
  await new Promise((r) => setImmediate(r));
  assert.equal(await gaugeValue(metrics.cluster.outboxPending), 7);
  assert.equal(await gaugeValue(metrics.cluster.deadLettersOpen), 4);
  assert.equal(ended, false, 'the reading ends only once the lag answered too');
  answerLag(42);
  await reading;
  assert.equal(await gaugeValue(metrics.cluster.kafkaLag), 42);
});
