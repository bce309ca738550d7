import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Admin } from '@platformatic/kafka';
import {
  consumerGroupLag,
  createKafka,
  deleteTopics,
  ensureTopics,
  RunPublisher,
} from '../../src/broker/index.js';
import { baseOptions } from '../../src/broker/client.js';
import { silentLogger } from '../../src/observability/logger.js';
import { serverEnv, uniqueId } from '../support/env.js';

// HeliosKafkaLag reads helios_kafka_consumer_lag_messages, the leader's consumerGroupLag: messages
// of the runs topic the workers' group has not committed. A group whose committed offset fell below
// the partition's earliest retained offset (its workers were away longer than the topic's retention,
// or records were deleted) resumes at that earliest offset: the records below it are gone and will
// never be consumed. They were counted as lag, so a partition that gets no new message kept the
// alert's figure up for good on a cluster with nothing to consume. Real Kafka.

const topic = `helios.test.${uniqueId()}`;
const group = `helios-lag-test-${uniqueId()}`;
const kafka = createKafka({
  brokers: serverEnv().kafkaBrokers.split(','),
  clientId: 'kafka-lag-alert-test',
  logger: silentLogger,
});
let admin: Admin;
let publisher: RunPublisher;

before(async () => {
  await ensureTopics(kafka, [{ name: topic, partitions: 1 }]);
  admin = new Admin(baseOptions(kafka));
  publisher = new RunPublisher({ kafka, logger: silentLogger });
});
after(async () => {
  await publisher.disconnect();
  await admin.deleteGroups({ groups: [group] }).catch(() => undefined);
  await admin.close().catch(() => undefined);
  await deleteTopics(kafka, [topic]).catch(() => undefined);
});

test("records deleted below the group's committed offset are not counted as lag", async () => {
  const messages = Array.from({ length: 1200 }, (_, i) => ({ key: `k${i % 7}`, value: `{"n":${i}}` }));
  await publisher.publish(topic, messages);
  // The group had consumed 10 of them; then the first 1,200 records were deleted (retention).
  await admin.alterConsumerGroupOffsets({
    groupId: group,
    topics: [{ name: topic, partitionOffsets: [{ partition: 0, offset: 10n }] }],
  });
  assert.equal(await consumerGroupLag(kafka, group, topic), 1190, 'the lag before the deletion');
  await admin.deleteRecords({ topics: [{ name: topic, partitions: [{ partition: 0, offset: 1200n }] }] });
  // Nothing is left to consume: the group resumes at the earliest offset, which is the end.
  assert.equal(await consumerGroupLag(kafka, group, topic), 0, 'deleted records counted as lag');
});
