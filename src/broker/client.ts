import type { BaseOptions } from '@platformatic/kafka';
import type { Logger } from '../observability/logger.js';

/**
 * How this node reaches the Kafka cluster. Opaque outside `src/broker/`: pass it to
 * {@link ensureTopics}, {@link RunPublisher} and {@link RunConsumer}, never use it directly, so the
 * client library can be replaced without touching the rest of Helios. It holds settings only:
 * `@platformatic/kafka` has no shared client object, each producer, consumer and admin client
 * opens (and reopens, after a broker restart) its own connections.
 */
export interface BrokerClient {
  readonly brokers: readonly string[];
  readonly clientId: string;
  readonly logger: Logger;
  readonly connectionTimeoutMs: number;
  readonly requestTimeoutMs: number;
}

/** Options of {@link createKafka}. */
export interface KafkaClientOptions {
  /** Bootstrap brokers, `host:port`. */
  brokers: string[];
  /** Client id sent with every request; shows up in broker logs and quotas. Use the node id. */
  clientId: string;
  /** Where the broker module logs (client errors it handled, consumer failures). */
  logger: Logger;
  /** TCP connect timeout per broker. Default 1000 ms: loopback or LAN connects take microseconds. */
  connectionTimeoutMs?: number;
  /**
   * Per-request timeout, Fetch and JoinGroup included (a JoinGroup waits up to the consumer's
   * rebalance timeout, which must stay below this). Default 5000 ms.
   */
  requestTimeoutMs?: number;
}

/**
 * Retries inside one library call (metadata, produce, join, commit). The library default
 * (3 retries, 1 s apart) holds a caller for 3 s of sleep alone while Kafka is away; here a failing
 * call gives up after about 0.75 s of back-off and the caller's own loop decides what next (the
 * outbox relay re-publishes, the intake replaces its consumer).
 */
const RETRIES = 3;
const RETRY_DELAY_MS = 250;

/** Records how this node reaches Kafka; opens no connection. */
export function createKafka(options: KafkaClientOptions): BrokerClient {
  return Object.freeze({
    brokers: Object.freeze([...options.brokers]),
    clientId: options.clientId,
    logger: options.logger,
    connectionTimeoutMs: options.connectionTimeoutMs ?? 1_000,
    requestTimeoutMs: options.requestTimeoutMs ?? 5_000,
  });
}

/** The options every producer, consumer and admin client of this node shares. */
export function baseOptions(kafka: BrokerClient): BaseOptions {
  return {
    clientId: kafka.clientId,
    bootstrapBrokers: [...kafka.brokers],
    connectTimeout: kafka.connectionTimeoutMs,
    requestTimeout: kafka.requestTimeoutMs,
    retries: RETRIES,
    retryDelay: RETRY_DELAY_MS,
    // The broker runs with auto.create.topics.enable=false; topics are made by ensureTopics.
    autocreateTopics: false,
  };
}
