import { Kafka } from 'kafkajs';
import type { Logger } from '../observability/logger.js';
import { kafkaLogLevel, pinoLogCreator } from './log.js';

/**
 * A connection factory for the Kafka cluster. Opaque outside `src/broker/`: pass it to
 * {@link ensureTopics}, {@link RunPublisher} and {@link RunConsumer}, never call it directly,
 * so the client library can be replaced without touching the rest of Helios.
 */
export type BrokerClient = Kafka;

/** Options of {@link createKafka}. */
export interface KafkaClientOptions {
  /** Bootstrap brokers, `host:port`. */
  brokers: string[];
  /** Client id sent with every request; shows up in broker logs and quotas. Use the node id. */
  clientId: string;
  /** Where kafkajs logs go (child logger `component: kafkajs`). */
  logger: Logger;
  /** TCP connect timeout per broker. Default 1000 ms: loopback or LAN connects take microseconds. */
  connectionTimeoutMs?: number;
  /** Per-request timeout (Fetch and JoinGroup get their own, longer ones). Default 5000 ms. */
  requestTimeoutMs?: number;
}

/**
 * Retries of kafkajs's internal retrier (metadata, produce, admin, consumer loop). The library
 * default (5 retries, 300 ms initial, 30 s cap) can block a caller for well over a minute; here a
 * failing call gives up after roughly 3 s of back-off and the caller's own loop decides what next
 * (the outbox relay re-publishes, the consumer restarts itself).
 */
const RETRY = { retries: 5, initialRetryTime: 100, maxRetryTime: 1_000, factor: 0.2, multiplier: 2 };

/** Creates the kafkajs client for this node; it opens no connection by itself. */
export function createKafka(options: KafkaClientOptions): BrokerClient {
  return new Kafka({
    brokers: options.brokers,
    clientId: options.clientId,
    connectionTimeout: options.connectionTimeoutMs ?? 1_000,
    requestTimeout: options.requestTimeoutMs ?? 5_000,
    enforceRequestTimeout: true,
    retry: RETRY,
    logLevel: kafkaLogLevel(options.logger),
    logCreator: pinoLogCreator(options.logger),
  });
}
