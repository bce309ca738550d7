export { createKafka, type BrokerClient, type KafkaClientOptions } from './client.js';
export { ensureTopics, deleteTopics, nodeTopics, type TopicSpec, type TopicState } from './topics.js';
export { TopicProvisioner, TopicsNotReadyError, type TopicProvisionerOptions } from './topic-provisioner.js';
export { describeGroup, type GroupState } from './groups.js';
export { RunPublisher, type RunPublisherOptions } from './publisher.js';
export { RunConsumer, type RunConsumerOptions, type MessageHandler } from './consumer.js';
export type { OutgoingMessage, ConsumedMessage, PublishReceipt } from './messages.js';
export { isBrokerRefusal, PublishError } from './errors.js';
export { consumerGroupLag } from './lag.js';
