import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { createKafka, deleteTopics, ensureTopics, RunPublisher } from '../../src/broker/index.js';
import { OutboxRelay } from '../../src/outbox/relay.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { Notifications } from '../../src/store/notifications.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { waitFor } from '../support/execution.js';

// The relay against the real broker and database: a row Kafka refuses must not hold back the rows
// behind it (before, the relay retried the same failing batch for ever).

const topic = `helios.test.${uniqueId()}`;
const kafka = createKafka({
  brokers: serverEnv().kafkaBrokers.split(','),
  clientId: 'relay-test',
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

test('a row the broker refuses is put off; the rows behind it are published', async () => {
  // Larger than the broker's message.max.bytes (1 MiB by default): Kafka refuses it for good.
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload) VALUES ($1, 'poison', jsonb_build_object('pad', repeat('x', 2000000)))`,
    [topic],
  );
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload) SELECT $1, 'k' || i, jsonb_build_object('i', i) FROM generate_series(1, 20) i`,
    [topic],
  );
  const abort = new AbortController();
  const relay = new OutboxRelay({
    pool: db.pool,
    publisher,
    notifications,
    signal: abort.signal,
    logger: silentLogger,
    metrics: createMetrics('relay-test'),
  });
  const running = relay.run();
  try {
    await waitFor(
      'the healthy rows to be published',
      async () => {
        const { rows } = await db.pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM outbox WHERE key <> 'poison' AND published_at IS NOT NULL`,
        );
        return rows[0]!.n === 20;
      },
      30_000,
    );
    const { rows } = await db.pool.query<{ publishedAt: Date | null; tries: number; putOff: boolean }>(
      `SELECT published_at AS "publishedAt", publish_tries AS tries, publish_after > created_at AS "putOff"
       FROM outbox WHERE key = 'poison'`,
    );
    assert.equal(rows[0]!.publishedAt, null, 'the refused row is still pending');
    assert.ok(rows[0]!.tries >= 1);
    assert.ok(rows[0]!.putOff, 'and put off, so the next batches do not start with it');
  } finally {
    abort.abort();
    await running;
  }
});
