import {
  Consumer,
  MessagesStreamFallbackModes,
  MessagesStreamModes,
  stringDeserializers,
  type Message,
  type MessagesStream,
} from '@platformatic/kafka';
import { LifecycleError, toError, withTimeout } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import { baseOptions, type BrokerClient } from './client.js';
import { kafkaErrorType } from './errors.js';
import { fromKafkaMessage, type ConsumedMessage } from './messages.js';

/**
 * Handles one message. The message's offset is committed only after the returned promise
 * resolves (soon after, not at once: commits are not awaited). A rejection fails the consumer
 * (its `onFailure` is called; the message is delivered again to whichever member takes the
 * partition next), so a handler records per-run failures itself and rejects only when it could
 * not take the message at all.
 */
export type MessageHandler = (message: ConsumedMessage) => Promise<void>;

/** Options of {@link RunConsumer}. */
export interface RunConsumerOptions {
  kafka: BrokerClient;
  logger: Logger;
  /** Consumer group: members share the topic's partitions. */
  groupId: string;
  topic: string;
  /**
   * Static membership (KIP-345): a member that comes back with the same instance id takes over
   * its old place in the group at once, with the same partitions and no rebalance, instead of
   * waiting for the coordinator to drop the old member. Must be unique among the live members of
   * the group (two live members with one id fence each other): use the node id. Default none (a
   * dynamic member).
   */
  groupInstanceId?: string;
  /**
   * Where a group without committed offsets starts. Default true (earliest): a message published
   * before the group first joined is still delivered; re-delivering an old run is harmless.
   */
  fromBeginning?: boolean;
  /**
   * The coordinator evicts a member silent for this long. Default 6000 ms, the broker's minimum
   * (`group.min.session.timeout.ms`): a crashed worker's partitions move on within 6 s.
   */
  sessionTimeoutMs?: number;
  /** Default 1000 ms: a rebalance is noticed within about a second. */
  heartbeatIntervalMs?: number;
  /**
   * How long the coordinator waits for members to re-join during a rebalance; the client insists
   * it is at least `sessionTimeoutMs`. Default: `sessionTimeoutMs`. It bounds how long the group
   * stays blocked by a dynamic member that is gone without a LeaveGroup (a crashed process whose
   * successor has another node id, so static membership does not help). The coordinator parks a
   * JoinGroup for up to this long, so this consumer's request timeout is raised above it.
   */
  rebalanceTimeoutMs?: number;
  /**
   * Fetch long-poll. A message is delivered as soon as it arrives regardless; this bounds how long
   * `stop()` waits for an idle fetch. Default 500 ms.
   */
  maxWaitTimeMs?: number;
  /** Deadline for connecting and first joining the group in `start`. Default 30000 ms. */
  startTimeoutMs?: number;
  /** Deadline for leaving the group and disconnecting in `stop`. Default 5000 ms. */
  stopTimeoutMs?: number;
  /**
   * Called when the consumer failed and will not recover by itself (it is then `failed`): its
   * message stream ended on an error the client gave up on (Kafka away for longer than the
   * client's retries, a commit that needs a re-join), or the group membership was lost for good.
   * The owner replaces it with a new consumer.
   */
  onFailure?: (error: Error) => void;
}

type ConsumerState = 'idle' | 'starting' | 'running' | 'failed' | 'stopping' | 'stopped';
type StringMessage = Message<string, string, string, string>;

/**
 * A member of a consumer group on one topic, with `pause()`/`resume()` for back-pressure.
 * At-least-once: an offset is committed only after its handler resolved, but not necessarily at
 * once, so after a crash or an eviction the last handled messages may be delivered again.
 */
export class RunConsumer {
  readonly #logger: Logger;
  readonly #topic: string;
  readonly #groupId: string;
  readonly #fromBeginning: boolean;
  readonly #startTimeoutMs: number;
  readonly #stopTimeoutMs: number;
  readonly #onFailure: ((error: Error) => void) | undefined;
  readonly #consumer: Consumer<string, string, string, string>;
  #state: ConsumerState = 'idle';
  #paused = false;
  #wakeUp: (() => void) | undefined;
  #stream: MessagesStream<string, string, string, string> | undefined;
  #loop: Promise<void> | undefined;
  /** The handler call in progress, if any. */
  #handling: Promise<void> | undefined;
  #starting: Promise<void> | undefined;
  #stopping: Promise<void> | undefined;

  constructor(options: RunConsumerOptions) {
    this.#logger = options.logger.child({ component: 'kafka-consumer', groupId: options.groupId });
    this.#topic = options.topic;
    this.#groupId = options.groupId;
    this.#fromBeginning = options.fromBeginning ?? true;
    this.#startTimeoutMs = options.startTimeoutMs ?? 30_000;
    this.#stopTimeoutMs = options.stopTimeoutMs ?? 5_000;
    this.#onFailure = options.onFailure;
    const sessionTimeoutMs = options.sessionTimeoutMs ?? 6_000;
    const rebalanceTimeoutMs = options.rebalanceTimeoutMs ?? sessionTimeoutMs;
    const base = baseOptions(options.kafka);
    this.#consumer = new Consumer({
      ...base,
      requestTimeout: Math.max(base.requestTimeout ?? 0, rebalanceTimeoutMs + 2_000),
      groupId: options.groupId,
      ...(options.groupInstanceId ? { groupInstanceId: options.groupInstanceId } : {}),
      sessionTimeout: sessionTimeoutMs,
      heartbeatInterval: options.heartbeatIntervalMs ?? 1_000,
      rebalanceTimeout: rebalanceTimeoutMs,
      maxWaitTime: options.maxWaitTimeMs ?? 500,
      // Offsets are committed per message after its handler (see #run); the client's autocommit
      // would commit what was fetched, handled or not.
      autocommit: false,
      deserializers: stringDeserializers,
    });
    this.#consumer.on('consumer:group:join', (event) => {
      this.#logger.info(
        {
          memberId: event.memberId,
          generationId: event.generationId,
          isLeader: event.isLeader,
          partitions: this.assignment,
        },
        'joined consumer group',
      );
    });
    // Heartbeat failures the client retries or answers by re-joining; only the last resort
    // (the 'error' event below) is ours to act on.
    this.#consumer.on('consumer:heartbeat:error', (event) => {
      this.#logger.debug(
        { err: event.error, kafkaError: kafkaErrorType(event.error) },
        'Kafka heartbeat failed',
      );
    });
    // Emitted when a re-join after a lost heartbeat failed: the client schedules no more
    // heartbeats, so this member is as good as gone.
    this.#consumer.on('error', (err: unknown) => this.#fail(toError(err)));
  }

  /** `idle`, `starting`, `running`, `failed`, `stopping` or `stopped`. */
  get state(): ConsumerState {
    return this.#state;
  }

  /** Partitions of the topic assigned to this member by the last rebalance. */
  get assignment(): readonly number[] {
    const mine = this.#consumer.assignments?.find((a) => a.topic === this.#topic);
    return [...(mine?.partitions ?? [])].sort((a, b) => a - b);
  }

  /**
   * Consumer lag of this member, for a lag gauge: per partition of the topic assigned to it, the
   * partition's end offset minus the offset this member last committed there. Partitions it does
   * not hold, or has committed nothing on yet, are left out. One ListOffsets request; rejects when
   * Kafka does not answer.
   */
  async lag(): Promise<{ partition: number; lag: bigint }[]> {
    const lags = await this.#consumer.getLag({ topics: [this.#topic] });
    return (lags.get(this.#topic) ?? [])
      .map((lag, partition) => ({ partition, lag }))
      .filter((p) => p.lag >= 0n);
  }

  /** True between `pause()` and `resume()`. */
  get paused(): boolean {
    return this.#paused;
  }

  /**
   * Connects, joins the group and starts delivering messages to `handler`; resolves once this
   * member has joined the group. A second call returns the first call's promise (and ignores its
   * handler). If it rejects, the consumer is `stopped`: create a new one to try again.
   */
  start(handler: MessageHandler): Promise<void> {
    if (this.#state === 'stopping' || this.#state === 'stopped') {
      return Promise.reject(new LifecycleError(`cannot start a consumer that is ${this.#state}`));
    }
    this.#starting ??= this.#start(handler);
    return this.#starting;
  }

  async #start(handler: MessageHandler): Promise<void> {
    this.#state = 'starting';
    try {
      // consume() joins the group (JoinGroup + SyncGroup) before it returns the stream.
      const consuming = this.#consumer.consume({
        topics: [this.#topic],
        mode: MessagesStreamModes.COMMITTED,
        fallbackMode: this.#fromBeginning
          ? MessagesStreamFallbackModes.EARLIEST
          : MessagesStreamFallbackModes.LATEST,
        autocommit: false,
      });
      consuming.catch(() => undefined); // abandoned when the deadline wins
      this.#stream = await withTimeout(
        consuming,
        this.#startTimeoutMs,
        `join consumer group ${this.#groupId}`,
      );
    } catch (err) {
      const error = toError(err);
      if (this.#state === 'starting') {
        // Not 'starting' any more, so stop() does not wait for this very start to settle.
        this.#state = 'failed';
        await this.stop().catch((e: unknown) =>
          this.#logger.warn({ err: toError(e) }, 'consumer did not stop cleanly after a failed start'),
        );
      }
      throw error;
    }
    if (this.#state !== 'starting') throw new LifecycleError('consumer was stopped while starting');
    this.#state = 'running';
    this.#loop = this.#run(this.#stream, handler);
  }

  /**
   * Stops delivering messages: no handler call starts after this returns. Messages fetched but
   * not yet handled are delivered after `resume()`. The member stays in the group.
   */
  pause(): void {
    this.#paused = true;
  }

  /** Delivers messages again. */
  resume(): void {
    this.#paused = false;
    this.#wakeUp?.();
  }

  /**
   * Waits (bounded by `stopTimeoutMs`) for the handler in progress, commits, leaves the group and
   * disconnects. A second call returns the first call's promise. Rejects with `TimeoutError` if
   * the client did not finish in time; the consumer is `stopped` either way.
   */
  stop(): Promise<void> {
    this.#stopping ??= this.#stop();
    return this.#stopping;
  }

  async #stop(): Promise<void> {
    const previous = this.#state;
    this.#state = 'stopping';
    this.#wakeUp?.();
    try {
      if (previous === 'starting' && this.#starting) {
        await withTimeout(this.#starting, this.#stopTimeoutMs, 'consumer start').catch(() => undefined);
      }
      if (previous !== 'idle')
        await withTimeout(this.#shutdown(), this.#stopTimeoutMs, `stop consumer group ${this.#groupId}`);
    } finally {
      this.#state = 'stopped';
    }
  }

  async #shutdown(): Promise<void> {
    // No handler starts once we are stopping (the loop checks the state before each message);
    // let the one in progress finish so its offset is committed.
    await this.#handling?.catch(() => undefined);
    // Closing the stream flushes the commits still queued and ends the loop; closing the consumer
    // then sends LeaveGroup, which hands our partitions to the other members now rather than
    // after sessionTimeoutMs.
    await this.#stream?.close();
    await this.#loop;
    await this.#consumer.close(true);
  }

  async #run(stream: MessagesStream<string, string, string, string>, handler: MessageHandler): Promise<void> {
    try {
      // destroyOnReturn false: leaving the loop (stop, a failed handler) must not destroy the
      // stream, or the offsets still queued for commit would be dropped with it; #shutdown closes
      // it, which flushes them.
      const messages = stream.iterator({ destroyOnReturn: false }) as AsyncIterable<StringMessage>;
      for await (const message of messages) {
        while (this.#paused && this.#state === 'running') {
          await new Promise<void>((resolve) => (this.#wakeUp = resolve));
          this.#wakeUp = undefined;
        }
        if (this.#state !== 'running') return;
        // Fetched before a rebalance took the partition away: its new owner delivers it; handling
        // it here too would only duplicate it, and committing it could move the new owner's
        // committed offset backwards.
        if (!this.assignment.includes(message.partition)) continue;
        this.#handling = handler(fromKafkaMessage(message));
        await this.#handling;
        this.#handling = undefined;
        // Not awaited: the client keeps one OffsetCommit in flight per stream and merges the
        // offsets queued meanwhile into the next, so Kafka 4's 5 ms commit linger costs one
        // round trip per batch of handled messages, not per message (what kafkajs needed
        // per-batch commits for).
        message.commit((err?: Error) => {
          // The offset stays queued and goes with the next commit; a commit that needs a re-join
          // ends the stream instead, and that failure is reported below.
          if (err) this.#logger.debug({ err, kafkaError: kafkaErrorType(err) }, 'Kafka offset commit failed');
        });
      }
      if (this.#state === 'running') this.#fail(new Error('Kafka message stream ended'));
    } catch (err) {
      if (this.#state === 'running') this.#fail(toError(err));
    }
  }

  #fail(error: Error): void {
    if (this.#state !== 'running' && this.#state !== 'starting') return;
    this.#logger.error({ err: error, kafkaError: kafkaErrorType(error) }, 'Kafka consumer failed');
    this.#state = 'failed';
    this.#wakeUp?.();
    try {
      this.#onFailure?.(error);
    } catch (err) {
      this.#logger.error({ err: toError(err) }, 'onFailure callback threw');
    }
  }
}
