import { Partitioners, type Producer, type RecordMetadata } from 'kafkajs';
import { LifecycleError, toError, withTimeout } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { BrokerClient } from './client.js';
import { PublishError, kafkaErrorType } from './errors.js';
import { toKafkaMessage, type OutgoingMessage, type PublishReceipt } from './messages.js';

/** Options of {@link RunPublisher}. */
export interface RunPublisherOptions {
  kafka: BrokerClient;
  logger: Logger;
  /** Our deadline for one `publish`, kafkajs's own retries included. Default 10000 ms. */
  sendTimeoutMs?: number;
  /** How long the broker may wait for all in-sync replicas to acknowledge. Default 5000 ms. */
  ackTimeoutMs?: number;
  /** Deadline for connecting and obtaining a producer id (InitProducerId). Default 10000 ms. */
  connectTimeoutMs?: number;
  /** Deadline for closing one producer in `disconnect`. Default 5000 ms. */
  disconnectTimeoutMs?: number;
}

type PublisherState = 'idle' | 'connecting' | 'connected' | 'disconnecting' | 'disconnected';

/** One kafkajs idempotent producer: one producer id and its per-partition sequence numbers. */
interface Session {
  producer: Producer;
  ready: Promise<void>;
  inflight: Set<Promise<unknown>>;
  discarded: boolean;
}

/**
 * Producer retries inside one `publish`. kafkajs defaults an idempotent producer to unlimited
 * retries, which would make a publish hang for as long as the broker is away; we bound them and
 * let the outbox relay retry instead (kafkajs warns this "may invalidate EoS guarantees": a
 * re-publish can duplicate a message, which Helios tolerates because claims are in PostgreSQL).
 */
const PRODUCER_RETRY = { retries: 5, initialRetryTime: 100, maxRetryTime: 1_000 };

/**
 * Publishes messages with an idempotent producer (`acks=all`), as the outbox relay needs.
 *
 * Every failed `publish` discards the underlying producer and the next one starts a new
 * idempotent session (new producer id, sequences from 0). kafkajs rolls a partition's sequence
 * number back when a produce request fails, even when the broker may have written the batch
 * (request timeout, connection lost after the write); the next, different batch of the same size
 * would then reuse that sequence and be silently dropped by the broker as a duplicate, and one of
 * another size is rejected with OUT_OF_ORDER_SEQUENCE_NUMBER for ever. A fresh session avoids
 * both, and also recovers from UNKNOWN_PRODUCER_ID / INVALID_PRODUCER_EPOCH after the broker
 * lost producer state. Cost: one InitProducerId round trip after a failure.
 *
 * Concurrent publishes are allowed (kafkajs serialises them per broker); when one fails, the
 * others on the same producer fail too and are retried by their callers.
 */
export class RunPublisher {
  readonly #kafka: BrokerClient;
  readonly #logger: Logger;
  readonly #sendTimeoutMs: number;
  readonly #ackTimeoutMs: number;
  readonly #connectTimeoutMs: number;
  readonly #disconnectTimeoutMs: number;
  #state: PublisherState = 'idle';
  #connecting: Promise<void> | undefined;
  #disconnecting: Promise<void> | undefined;
  #session: Session | undefined;
  /** Producers being closed in the background; `disconnect` waits for them. */
  readonly #closing = new Set<Promise<void>>();

  constructor(options: RunPublisherOptions) {
    this.#kafka = options.kafka;
    this.#logger = options.logger.child({ component: 'kafka-publisher' });
    this.#sendTimeoutMs = options.sendTimeoutMs ?? 10_000;
    this.#ackTimeoutMs = options.ackTimeoutMs ?? 5_000;
    this.#connectTimeoutMs = options.connectTimeoutMs ?? 10_000;
    this.#disconnectTimeoutMs = options.disconnectTimeoutMs ?? 5_000;
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
      await this.#currentSession().ready;
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
   * Publishes `messages` to `topic` and resolves once all in-sync replicas have them; connects
   * first if `connect` was not called (or failed). Throws `LifecycleError` after `disconnect`.
   * Rejects with {@link PublishError} (cause: the client error or our `TimeoutError`); the
   * messages may or may not have been written, so the caller retries and consumers must
   * tolerate duplicates. Keep a batch under the broker's `message.max.bytes` (1 MiB default).
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
    const session = this.#currentSession();
    const send = (async () => {
      await session.ready;
      return session.producer.send({
        topic,
        acks: -1,
        timeout: this.#ackTimeoutMs,
        messages: messages.map(toKafkaMessage),
      });
    })();
    session.inflight.add(send);
    void send.then(
      () => session.inflight.delete(send),
      () => session.inflight.delete(send),
    );
    try {
      const metadata = await withTimeout(send, this.#sendTimeoutMs, `publish to ${topic}`);
      return metadata.map((m) => toReceipt(topic, m));
    } catch (err) {
      const cause = toError(err);
      this.#discard(session, cause);
      throw new PublishError(topic, messages.length, { cause });
    }
  }

  /**
   * Closes the producer, waiting (bounded) for producers discarded earlier. A second call returns
   * the first call's promise. Publishes still in flight fail.
   */
  disconnect(): Promise<void> {
    this.#disconnecting ??= this.#disconnect();
    return this.#disconnecting;
  }

  async #disconnect(): Promise<void> {
    this.#state = 'disconnecting';
    await this.#connecting?.catch(() => undefined);
    if (this.#session) this.#discard(this.#session);
    await Promise.all(this.#closing);
    this.#state = 'disconnected';
  }

  #currentSession(): Session {
    if (this.#session) return this.#session;
    const producer = this.#kafka.producer({
      idempotent: true,
      // kafkajs keeps one produce request per broker in flight for an idempotent producer anyway
      // (it locks the broker while a batch is outstanding); 1 says so explicitly.
      maxInFlightRequests: 1,
      allowAutoTopicCreation: false,
      // Java-compatible murmur2 partitioning (kafkajs 2.x default), named to silence its warning.
      createPartitioner: Partitioners.DefaultPartitioner,
      retry: PRODUCER_RETRY,
    });
    const session: Session = {
      producer,
      ready: withTimeout(producer.connect(), this.#connectTimeoutMs, 'Kafka producer connect'),
      inflight: new Set(),
      discarded: false,
    };
    // A producer that failed to connect is useless; the next publish opens a new one.
    session.ready.catch((err: unknown) => this.#discard(session, toError(err)));
    this.#session = session;
    return session;
  }

  /** Drops `session` (the next publish opens a new one) and closes it in the background. */
  #discard(session: Session, reason?: Error): void {
    if (session.discarded) return;
    session.discarded = true;
    if (this.#session === session) this.#session = undefined;
    if (reason) {
      this.#logger.warn(
        { err: reason, kafkaError: kafkaErrorType(reason) },
        'Kafka producer failed; the next publish starts a new idempotent producer',
      );
    }
    const closing = this.#close(session).finally(() => this.#closing.delete(closing));
    this.#closing.add(closing);
  }

  /** Disconnects `session`; never rejects (it runs in the background). */
  async #close(session: Session): Promise<void> {
    const disconnect = async () => {
      try {
        await withTimeout(
          session.producer.disconnect(),
          this.#disconnectTimeoutMs,
          'Kafka producer disconnect',
        );
      } catch (err) {
        this.#logger.warn({ err: toError(err) }, 'Kafka producer did not disconnect cleanly');
      }
    };
    await disconnect();
    if (session.inflight.size === 0) return;
    // A send still inside kafkajs's retrier reconnects the client when it finds it disconnected;
    // once those sends have failed, disconnect again so no socket outlives the publisher.
    await withTimeout(
      Promise.allSettled(session.inflight),
      this.#disconnectTimeoutMs,
      'abandoned sends',
    ).catch(() => undefined);
    await disconnect();
  }
}

function toReceipt(topic: string, metadata: RecordMetadata): PublishReceipt {
  return {
    topic: metadata.topicName || topic,
    partition: metadata.partition,
    baseOffset: metadata.baseOffset ?? metadata.offset ?? '-1',
  };
}
