import assert from 'node:assert/strict';
import { waitFor } from '../support/execution.js';
import { after, before, test } from 'node:test';
import { createKafka, deleteTopics, ensureTopics, RunPublisher } from '../../src/broker/index.js';
import { OutboxRelay } from '../../src/outbox/relay.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { readClusterCounts } from '../../src/store/signals.js';
import { Notifications } from '../../src/store/notifications.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';

// HeliosOutboxStalled (deploy/prometheus/alerts.yml; docs/operations.md: "runs are created but not
// announced: Kafka is down or refusing") on the real relay, broker and database. A row the broker
// refuses for good is put off again and again (relay.ts isolate): its publish_after moves on at
// each try, so the age the leader exports (helios_outbox_oldest_pending_age_seconds, read from
// publish_after) never passed 30 s however long the row had waited, and nothing else the alert
// reads moved.

const topic = `helios.test.${uniqueId()}`;
const kafka = createKafka({
  brokers: serverEnv().kafkaBrokers.split(','),
  clientId: 'outbox-stalled-alert-test',
  logger: silentLogger,
});
let db: TestDatabase;
let notifications: Notifications;
let publisher: RunPublisher;

before(async () => {
  db = await createTestDatabase();
  await ensureTopics(kafka, [{ name: topic, partitions: 1 }]);
  notifications = new Notifications(db.url, ['helios_outbox'], silentLogger);
  notifications.start();
  publisher = new RunPublisher({ kafka, logger: silentLogger });
});
after(async () => {
  await publisher.disconnect();
  await notifications.stop();
  await deleteTopics(kafka, [topic]).catch(() => undefined);
  await db.drop();
});

/** A counter's value in the node's registry (0 when it is not there). */
async function counter(metrics: ReturnType<typeof createMetrics>, name: string): Promise<number> {
  const metric = (await metrics.registry.getMetricsAsJSON()).find((m) => m.name === name);
  return (metric?.values ?? []).reduce((sum, v) => sum + v.value, 0);
}

test('a row the broker keeps refusing makes HeliosOutboxStalled fire', async () => {
  // Larger than the broker's message.max.bytes (1 MiB by default): Kafka refuses it for good.
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload) VALUES ($1, 'poison', jsonb_build_object('pad', repeat('x', 2000000)))`,
    [topic],
  );
  const metrics = createMetrics('outbox-stalled-alert');
  metrics.exportClusterGauges(true);
  const abort = new AbortController();
  const relay = new OutboxRelay({
    pool: db.pool,
    publisher,
    notifications,
    signal: abort.signal,
    logger: silentLogger,
    metrics,
  }).run();
  const tries = async () =>
    (await db.pool.query<{ tries: number }>(`SELECT publish_tries AS tries FROM outbox WHERE key = 'poison'`))
      .rows[0]!.tries;
  try {
    // Refused and put off twice: the row waits on, its publish_after moving on each time.
    await waitFor('two refused tries', async () => (await tries()) >= 2, 30_000, 200);
  } finally {
    abort.abort();
    await relay;
  }
  const { rows } = await db.pool.query<{ waitedS: number; published: boolean; tries: number }>(
    `SELECT extract(epoch FROM now() - created_at)::float8 AS "waitedS", published_at IS NOT NULL AS published,
            publish_tries AS tries
     FROM outbox WHERE key = 'poison'`,
  );
  const row = rows[0]!;
  assert.equal(row.published, false, 'the broker refused the row');
  assert.ok(row.tries >= 2, `the row waited ${row.waitedS} s over ${row.tries} tries`);
  // What the leader exports (ClusterSignals sets the gauge from this reading) and the counters.
  const counts = await readClusterCounts(db.pool, 5000, 100_000);
  const refused = await counter(metrics, 'helios_outbox_rows_refused_total');
  // The rule: max(helios_outbox_oldest_pending_age_seconds) > 30
  //           or sum(increase(helios_outbox_rows_refused_total[5m])) > 0
  assert.ok(
    counts.outboxOldestAgeSeconds > 30 || refused > 0,
    `a row unpublished for ${Math.round(row.waitedS)} s; the alert reads an age of ` +
      `${counts.outboxOldestAgeSeconds.toFixed(1)} s and ${refused} refused rows`,
  );
});
