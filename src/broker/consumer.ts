import type { Consumer, ConsumerCrashEvent, ConsumerGroupJoinEvent, EachBatchPayload } from 'kafkajs';
import { LifecycleError, toError, withTimeout } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { BrokerClient } from './client.js';
import { fromKafkaMessage, type ConsumedMessage } from './messages.js';

/**
 * Handles one message. The message's offset is committed only after the returned promise
 * resolves (soon after, not at once: see {@link RunConsumerOptions.commitIntervalMs}). A rejection makes the client re-deliver the same message after a back-off (and
 * blocks its partition meanwhile), so a handler records per-run failures itself and rejects only
 * when it could not take the message at all.
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
   * Where a group without committed offsets starts. Default true (earliest): a message published
   * before the group first joined is still delivered; re-delivering an old run is harmless.
   */
  fromBeginning?: boolean;
  /** The coordinator evicts a member silent for this long. Default 10000 ms (broker minimum 6000). */
  sessionTimeoutMs?: number;
  /** Default 1000 ms: a rebalance is noticed within about a second. */
  heartbeatIntervalMs?: number;
  /**
   * How long the coordinator waits for members to re-join (and then to sync) during a rebalance.
   * Default 4000 ms. It bounds how long the group stays blocked by members that are gone without a
   * LeaveGroup: after a broker restart the coordinator reloads the group with its old members,
   * but kafkajs restarts a crashed consumer as a new member (it drops its member id), so every
   * rejoin waits this long for the old ids. It must stay below the client request timeout
   * (5000 ms), so a parked SyncGroup is answered by the coordinator before kafkajs gives up on it
   * and crashes again. Members notice a rebalance within about `heartbeatIntervalMs` +
   * `maxWaitTimeMs` (about 1.5 s), which leaves a loaded event loop some slack; one that misses
   * the window is dropped and re-joins.
   */
  rebalanceTimeoutMs?: number;
  /**
   * Fetch long-poll. A message is delivered as soon as it arrives regardless; this bounds how long
   * `stop()` waits for an idle fetch and how quickly `resume()` takes effect. Default 500 ms.
   */
  maxWaitTimeMs?: number;
  /**
   * Longest time a handled message stays uncommitted within a long batch. Offsets are also
   * committed at the end of every fetched batch, so at low rates each message is committed
   * right after its handler. Committing after every message instead would cap a partition at
   * about 150 messages/s: Kafka 4's group coordinator lingers `group.coordinator.append.linger.ms`
   * (5 ms) on every OffsetCommit. Default 1000 ms.
   */
  commitIntervalMs?: number;
  /** Partitions handled in parallel by this member. Default 1. */
  partitionsConsumedConcurrently?: number;
  /** Deadline for connecting and first joining the group in `start`. Default 30000 ms. */
  startTimeoutMs?: number;
  /** Deadline for leaving the group and disconnecting in `stop`. Default 5000 ms. */
  stopTimeoutMs?: number;
  /** Called when the client crashed and will not restart itself (the consumer is then `failed`). */
  onFailure?: (error: Error) => void;
}

type ConsumerState = 'idle' | 'starting' | 'running' | 'failed' | 'stopping' | 'stopped';

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
  readonly #concurrency: number;
  readonly #commitIntervalMs: number;
  readonly #startTimeoutMs: number;
  readonly #stopTimeoutMs: number;
  readonly #onFailure: ((error: Error) => void) | undefined;
  readonly #consumer: Consumer;
  #state: ConsumerState = 'idle';
  #paused = false;
  #assignment: readonly number[] = [];
  #starting: Promise<void> | undefined;
  #stopping: Promise<void> | undefined;
  readonly #unsubscribe: (() => void)[] = [];

  constructor(options: RunConsumerOptions) {
    this.#logger = options.logger.child({ component: 'kafka-consumer', groupId: options.groupId });
    this.#topic = options.topic;
    this.#groupId = options.groupId;
    this.#fromBeginning = options.fromBeginning ?? true;
    this.#concurrency = options.partitionsConsumedConcurrently ?? 1;
    this.#commitIntervalMs = options.commitIntervalMs ?? 1_000;
    this.#startTimeoutMs = options.startTimeoutMs ?? 30_000;
    this.#stopTimeoutMs = options.stopTimeoutMs ?? 5_000;
    this.#onFailure = options.onFailure;
    this.#consumer = options.kafka.consumer({
      groupId: options.groupId,
      sessionTimeout: options.sessionTimeoutMs ?? 10_000,
      heartbeatInterval: options.heartbeatIntervalMs ?? 1_000,
      rebalanceTimeout: options.rebalanceTimeoutMs ?? 4_000,
      maxWaitTimeInMs: options.maxWaitTimeMs ?? 500,
      allowAutoTopicCreation: false,
      // After a retriable crash the client restarts itself on a timer; a crash while we are
      // stopping must not bring it back.
      retry: { restartOnFailure: async () => this.#state !== 'stopping' && this.#state !== 'stopped' },
    });
  }

  /** `idle`, `starting`, `running`, `failed`, `stopping` or `stopped`. */
  get state(): ConsumerState {
    return this.#state;
  }

  /** Partitions of the topic assigned to this member by the last rebalance. */
  get assignment(): readonly number[] {
    return this.#assignment;
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
    const joined = new Promise<void>((resolve, reject) => {
      this.#unsubscribe.push(
        this.#consumer.on(this.#consumer.events.GROUP_JOIN, (event) => {
          this.#onJoin(event);
          resolve();
        }),
        this.#consumer.on(this.#consumer.events.CRASH, (event) => {
          this.#onCrash(event);
          if (!event.payload.restart) reject(toError(event.payload.error));
        }),
      );
    });
    joined.catch(() => undefined); // observed below; a crash after start must not be unhandled
    try {
      await withTimeout(
        (async () => {
          await this.#consumer.connect();
          await this.#consumer.subscribe({ topic: this.#topic, fromBeginning: this.#fromBeginning });
          const running = this.#consumer.run({
            eachBatch: (payload) => this.#eachBatch(payload, handler),
            // We resolve each offset after its handler; the client commits resolved offsets at the
            // end of every fetched batch, before a rebalance or stop, and every commitIntervalMs.
            eachBatchAutoResolve: false,
            autoCommit: true,
            autoCommitInterval: this.#commitIntervalMs,
            partitionsConsumedConcurrently: this.#concurrency,
          });
          // run() has created the client's group state synchronously: a pause() that came before
          // start() takes effect before the first fetch.
          if (this.#paused) this.#applyPause();
          await running;
          await joined;
        })(),
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
  }

  /**
   * Stops delivering messages: no handler call starts after this returns. Messages fetched but
   * not yet handled are delivered again after `resume()`. The member stays in the group.
   */
  pause(): void {
    this.#paused = true;
    if (this.#state === 'starting' || this.#state === 'running') this.#applyPause();
  }

  /** Delivers messages again; takes effect within about `maxWaitTimeMs`. */
  resume(): void {
    this.#paused = false;
    if (this.#state !== 'starting' && this.#state !== 'running') return;
    try {
      this.#consumer.resume([{ topic: this.#topic }]);
    } catch {
      // The client is between a crash and its restart; a new group session starts unpaused.
    }
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
    try {
      // Disconnecting in the middle of the first join would not stop the client: its join fails,
      // it treats that as a crash and restarts itself later. Let the join settle first.
      if (previous === 'starting' && this.#starting) {
        await withTimeout(this.#starting, this.#stopTimeoutMs, 'consumer start').catch(() => undefined);
      }
      if (previous !== 'idle') await this.#shutdown();
    } finally {
      this.#state = 'stopped';
    }
  }

  async #shutdown(): Promise<void> {
    try {
      // Leaving the group (inside disconnect) hands our partitions to the other members now
      // rather than after sessionTimeoutMs.
      await withTimeout(
        this.#consumer.disconnect(),
        this.#stopTimeoutMs,
        `stop consumer group ${this.#groupId}`,
      );
    } finally {
      for (const unsubscribe of this.#unsubscribe.splice(0)) unsubscribe();
    }
  }

  async #eachBatch(payload: EachBatchPayload, handler: MessageHandler): Promise<void> {
    const { batch } = payload;
    for (const message of batch.messages) {
      // Stale: a seek or rebalance happened; the client fetches again from the right offset.
      if (!payload.isRunning() || payload.isStale()) return;
      if (this.#paused) {
        // Leaving the rest unresolved makes the next fetch after resume() start from here. The
        // client pause is re-applied in case its group state was recreated after a crash.
        this.#applyPause();
        return;
      }
      await handler(fromKafkaMessage(batch.topic, batch.partition, message));
      payload.resolveOffset(message.offset);
      await payload.commitOffsetsIfNecessary();
      await payload.heartbeat();
    }
  }

  #applyPause(): void {
    try {
      this.#consumer.pause([{ topic: this.#topic }]);
    } catch {
      // The client is between a crash and its restart; #onJoin pauses the new group session.
    }
  }

  #onJoin(event: ConsumerGroupJoinEvent): void {
    const { memberAssignment, memberId, isLeader, duration } = event.payload;
    this.#assignment = [...(memberAssignment[this.#topic] ?? [])].sort((a, b) => a - b);
    if (this.#paused) this.#applyPause();
    this.#logger.info(
      { memberId, isLeader, partitions: this.#assignment, durationMs: duration },
      'joined consumer group',
    );
  }

  #onCrash(event: ConsumerCrashEvent): void {
    const { error, restart } = event.payload;
    if (restart) {
      this.#logger.warn({ err: error }, 'Kafka consumer crashed; the client restarts it');
      return;
    }
    this.#logger.error({ err: error }, 'Kafka consumer crashed and will not restart');
    if (this.#state === 'running') this.#state = 'failed';
    try {
      this.#onFailure?.(toError(error));
    } catch (err) {
      this.#logger.error({ err: toError(err) }, 'onFailure callback threw');
    }
  }
}
