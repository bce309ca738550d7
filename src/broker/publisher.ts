import { compatibilityPartitioner, ProduceAcks, Producer, stringSerializers } from '@platformatic/kafka';
import { LifecycleError, toError, withTimeout } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import { baseOptions, type BrokerClient } from './client.js';
import { PublishError, kafkaErrorType } from './errors.js';
import { toKafkaMessage, type OutgoingMessage, type PublishReceipt } from './messages.js';

/** Options of {@link RunPublisher}. */
export interface RunPublisherOptions {
  kafka: BrokerClient;
  logger: Logger;
  /** Our deadline for one `publish`, the client's own retries included. Default 10000 ms. */
  sendTimeoutMs?: number;
  /** How long the broker may wait for all in-sync replicas to acknowledge. Default 5000 ms. */
  ackTimeoutMs?: number;
  /** Deadline for connecting and obtaining a producer id (InitProducerId). Default 10000 ms. */
  connectTimeoutMs?: number;
  /** Deadline for closing the producer in `disconnect`. Default 5000 ms. */
  disconnectTimeoutMs?: number;
}

type PublisherState = 'idle' | 'connecting' | 'connected' | 'disconnecting' | 'disconnected';

/**
 * Publishes messages with an idempotent producer (`acks=all`), as the outbox relay needs.
 *
 * A failed publish needs nothing from us: `@platformatic/kafka` drops its producer id and
 * sequence numbers after any failed idempotent send, so the next send starts a new idempotent
 * session (InitProducerId) instead of reusing a sequence the broker may already hold; it also
 * re-initialises by itself on UNKNOWN_PRODUCER_ID or OUT_OF_ORDER_SEQUENCE_NUMBER (the broker
 * lost producer state). Retries inside one send keep their sequence, so the broker drops a batch
 * it already wrote instead of writing it twice.
 *
 * Concurrent publishes are allowed (up to 5 requests in flight per connection, which Kafka's
 * idempotence covers).
 */
export class RunPublisher {
  readonly #logger: Logger;
  readonly #sendTimeoutMs: number;
  readonly #connectTimeoutMs: number;
  readonly #disconnectTimeoutMs: number;
  readonly #producer: Producer<string, string, string, string>;
  #state: PublisherState = 'idle';
  #connecting: Promise<void> | undefined;
  #disconnecting: Promise<void> | undefined;

  constructor(options: RunPublisherOptions) {
    this.#logger = options.logger.child({ component: 'kafka-publisher' });
    this.#sendTimeoutMs = options.sendTimeoutMs ?? 10_000;
    this.#connectTimeoutMs = options.connectTimeoutMs ?? 10_000;
    this.#disconnectTimeoutMs = options.disconnectTimeoutMs ?? 5_000;
    this.#producer = new Producer({
      ...baseOptions(options.kafka),
      // The produce request's own timeout: how long the leader waits for the in-sync replicas.
      timeout: options.ackTimeoutMs ?? 5_000,
      idempotent: true,
      acks: ProduceAcks.ALL,
      // Java-compatible murmur2 (what kafkajs's DefaultPartitioner did): a key keeps its partition
      // across the client change and matches any Java producer. The library's default partitioner
      // differs for keys whose hash is negative.
      partitioner: compatibilityPartitioner,
      serializers: stringSerializers,
    });
  }

  /** `idle`, `connecting`, `connected`, `disconnecting` or `disconnected`. */
  get state(): PublisherState {
    return this.#state;
  }

  /**
   * Connects and obtains a producer id, so that a broken broker address shows at start-up rather
   * than at the first publish (which connects by itself otherwise). A second call returns the
   * first call's promise; after a failure the publisher is `idle` again and may be retried.
   */
  connect(): Promise<void> {
    if (this.#state === 'disconnecting' || this.#state === 'disconnected') {
      return Promise.reject(new LifecycleError(`cannot connect a publisher that is ${this.#state}`));
    }
    this.#connecting ??= this.#connect();
    return this.#connecting;
  }

  async #connect(): Promise<void> {
    this.#state = 'connecting';
    try {
      const init = this.#producer.initIdempotentProducer({});
      init.catch(() => undefined); // abandoned when the deadline wins
      await withTimeout(init, this.#connectTimeoutMs, 'Kafka producer connect');
    } catch (err) {
      if (this.#state === 'connecting') {
        this.#state = 'idle';
        this.#connecting = undefined;
      }
      throw toError(err);
    }
    if (this.#state !== 'connecting') throw new LifecycleError('publisher was disconnected while connecting');
    this.#state = 'connected';
  }

  /**
   * Publishes `messages` to `topic` and resolves once all in-sync replicas have them. Rejects with
   * {@link PublishError} (the messages may or may not have been written: retry them) or
   * `LifecycleError` after `disconnect`.
   */
  async publish(topic: string, messages: OutgoingMessage[]): Promise<PublishReceipt[]> {
    if (this.#state === 'idle' || this.#state === 'connecting') {
      // Connecting on first use means a node can start while Kafka is briefly away: the relay's
      // retries then double as connection retries.
      try {
        await this.connect();
      } catch (err) {
        if (err instanceof LifecycleError) throw err;
        throw new PublishError(topic, messages.length, { cause: toError(err) });
      }
    }
    if (this.#state !== 'connected') throw new LifecycleError(`cannot publish while ${this.#state}`);
    if (messages.length === 0) return [];
    const send = this.#producer.send({ messages: messages.map((m) => toKafkaMessage(topic, m)) });
    send.catch(() => undefined); // abandoned when the deadline wins
    try {
      const result = await withTimeout(send, this.#sendTimeoutMs, `publish to ${topic}`);
      return (result.offsets ?? []).map((o) => ({
        topic: o.topic || topic,
        partition: o.partition,
        baseOffset: o.offset.toString(),
      }));
    } catch (err) {
      const cause = toError(err);
      this.#logger.warn({ err: cause, kafkaError: kafkaErrorType(cause) }, 'Kafka publish failed');
      throw new PublishError(topic, messages.length, { cause });
    }
  }

  /** Closes the producer (bounded). A second call returns the first call's promise. */
  disconnect(): Promise<void> {
    this.#disconnecting ??= this.#disconnect();
    return this.#disconnecting;
  }

  async #disconnect(): Promise<void> {
    this.#state = 'disconnecting';
    await this.#connecting?.catch(() => undefined);
    try {
      await withTimeout(this.#producer.close(), this.#disconnectTimeoutMs, 'Kafka producer disconnect');
    } catch (err) {
      this.#logger.warn({ err: toError(err) }, 'Kafka producer did not disconnect cleanly');
    } finally {
      this.#state = 'disconnected';
    }
  }
}
