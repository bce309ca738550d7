import { setTimeout as sleep } from 'node:timers/promises';
import { RunConsumer, type BrokerClient, type ConsumedMessage } from '../broker/index.js';
import { LifecycleError, toError } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import { InvalidRunMessageError, parseRunMessage, type RunMessage } from './run-message.js';
import { loopBackoffMs } from '../loop-backoff.js';

/** Options of {@link KafkaIntake}. */
export interface KafkaIntakeOptions {
  readonly kafka: BrokerClient;
  readonly topic: string;
  readonly groupId: string;
  /**
   * Static group membership (KIP-345): the node id, so a consumer that replaces a failed one (or
   * a node restarted with the same `HELIOS_NODE_ID`) takes over its place in the group at once.
   */
  readonly instanceId?: string;
  readonly logger: Logger;
  /** Takes one announcement; must not block (it holds the partition while it runs). */
  readonly accept: (message: RunMessage) => void;
}

type State = 'idle' | 'running' | 'stopping' | 'stopped';

/** Longest pause between attempts to bring a failed consumer back. */
const MAX_RESTART_DELAY_MS = 5_000;

/**
 * The worker's Kafka side: one member of the workers' consumer group, kept alive across broker
 * outages (a consumer that crashed for good is replaced by a new one, with back-off), with
 * `pause()`/`resume()` for back-pressure that survive the replacement.
 *
 * A message's offset is committed once `accept` returned, i.e. before its run is claimed: the
 * handler must not hold a partition for the second a run waits for its time. A message lost with
 * a crashed node is therefore not re-delivered; its run is claimed by the polling fallback.
 */
export class KafkaIntake {
  private state: State = 'idle';
  private readonly abort = new AbortController();
  private consumer?: RunConsumer;
  private paused = false;
  private loop?: Promise<void>;
  private stopping?: Promise<void>;

  constructor(private readonly options: KafkaIntakeOptions) {}

  /** Starts consuming in the background; joining the group is logged by the consumer. */
  start(): void {
    if (this.state !== 'idle') throw new LifecycleError(`intake is ${this.state}`);
    this.state = 'running';
    this.loop = this.supervise();
  }

  /** Stops handing out messages (no `accept` call starts after this returns). */
  pause(): void {
    this.paused = true;
    this.consumer?.pause();
  }

  resume(): void {
    this.paused = false;
    this.consumer?.resume();
  }

  /** Pauses at once, then leaves the group and disconnects. Safe to call twice. */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      this.state = 'stopping';
      this.consumer?.pause();
      this.abort.abort();
      await this.loop;
      this.state = 'stopped';
    })();
    return this.stopping;
  }

  private async supervise(): Promise<void> {
    const { logger } = this.options;
    const signal = this.abort.signal;
    const aborted = new Promise<undefined>((resolve) => {
      if (signal.aborted) resolve(undefined);
      else signal.addEventListener('abort', () => resolve(undefined), { once: true });
    });
    let failures = 0;
    while (!signal.aborted) {
      let failed!: (err: Error) => void;
      const failure = new Promise<Error>((resolve) => (failed = resolve));
      const consumer = (this.consumer = new RunConsumer({
        kafka: this.options.kafka,
        logger,
        groupId: this.options.groupId,
        groupInstanceId: this.options.instanceId,
        topic: this.options.topic,
        onFailure: failed,
      }));
      if (this.paused) consumer.pause();
      try {
        // Joining can take up to the consumer's start timeout while Kafka is away; a stop must
        // not wait for it (the consumer's own stop() settles a pending start, bounded).
        const started = consumer.start((message) => this.handle(message));
        started.catch(() => undefined);
        await Promise.race([started, aborted]);
        if (signal.aborted) break;
        failures = 0;
        const err = await Promise.race([failure, aborted]);
        if (err) logger.warn({ err }, 'Kafka consumer failed; starting a new one');
      } catch (err) {
        if (!signal.aborted) logger.warn({ err: toError(err) }, 'Kafka consumer did not start; retrying');
      } finally {
        await consumer
          .stop()
          .catch((err: unknown) => logger.warn({ err: toError(err) }, 'Kafka consumer did not stop cleanly'));
      }
      if (signal.aborted) break;
      failures += 1;
      // The polling fallback keeps runs executing meanwhile, so a patient back-off costs little.
      await sleep(loopBackoffMs(failures, MAX_RESTART_DELAY_MS, 250), undefined, { signal }).catch(
        () => undefined,
      );
    }
  }

  private async handle(message: ConsumedMessage): Promise<void> {
    try {
      this.options.accept(parseRunMessage(message.value));
    } catch (err) {
      // A message we cannot read would be re-delivered for ever if we rejected: drop it, loudly.
      const error = toError(err);
      const level = error instanceof InvalidRunMessageError ? 'warn' : 'error';
      this.options.logger[level](
        { err: error, partition: message.partition, offset: message.offset },
        'dropping an unusable run message',
      );
    }
  }
}
