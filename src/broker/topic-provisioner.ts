import { setTimeout as sleep } from 'node:timers/promises';
import { LifecycleError, toError } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { BrokerClient } from './client.js';
import { ensureTopics, type TopicSpec } from './topics.js';

/** Options of {@link TopicProvisioner}. */
export interface TopicProvisionerOptions {
  readonly kafka: BrokerClient;
  readonly topics: TopicSpec[];
  readonly logger: Logger;
  /** Deadline of one attempt (connect, create, wait for partition leaders). Default 15000 ms. */
  readonly attemptTimeoutMs?: number;
  /** First pause after a failed attempt; it doubles up to `maxDelayMs`. Default 250 ms. */
  readonly minDelayMs?: number;
  /** Longest pause between attempts. Default 10000 ms. */
  readonly maxDelayMs?: number;
}

/** The topics are not (yet) known to exist: Kafka is unreachable or has not answered. */
export class TopicsNotReadyError extends Error {
  override name = 'TopicsNotReadyError';
}

type State = 'idle' | 'running' | 'stopping' | 'stopped';

/**
 * Ensures the node's topics in the background, retrying with back-off until it succeeds once.
 * A node must start while Kafka is down: workers execute runs through the polling fallback, and
 * the API needs no Kafka at all. Whatever publishes waits on {@link whenReady}; readiness reports
 * Kafka as degraded until then.
 */
export class TopicProvisioner {
  private state: State = 'idle';
  private readonly abort = new AbortController();
  private loop: Promise<void> = Promise.resolve();
  private stopping?: Promise<void>;
  private isReady = false;
  private markReady!: () => void;
  private readonly readyPromise = new Promise<void>((resolve) => (this.markReady = resolve));

  constructor(private readonly options: TopicProvisionerOptions) {}

  /** True once every topic exists with a leader for each partition. */
  get ready(): boolean {
    return this.isReady;
  }

  /** Starts the attempts in the background. */
  start(): void {
    if (this.state !== 'idle') throw new LifecycleError(`topic provisioner is ${this.state}`);
    this.state = 'running';
    this.loop = this.provision();
  }

  /** Resolves once the topics are ready; rejects with the signal's reason when it aborts first. */
  whenReady(signal: AbortSignal): Promise<void> {
    if (this.ready) return Promise.resolve();
    if (signal.aborted) return Promise.reject(toError(signal.reason));
    return new Promise<void>((resolve, reject) => {
      const onAbort = () => reject(toError(signal.reason));
      signal.addEventListener('abort', onAbort, { once: true });
      void this.readyPromise.then(() => {
        signal.removeEventListener('abort', onAbort);
        resolve();
      });
    });
  }

  /** Throws {@link TopicsNotReadyError} until the topics are ready (for readiness probes). */
  check(): void {
    if (!this.ready) throw new TopicsNotReadyError('Kafka topics are not ensured yet');
  }

  /** Abandons an attempt in progress. Safe to call twice. */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      this.state = 'stopping';
      this.abort.abort(new LifecycleError('topic provisioner stopped'));
      await this.loop;
      this.state = 'stopped';
    })();
    return this.stopping;
  }

  private async provision(): Promise<void> {
    const { kafka, topics, logger } = this.options;
    const signal = this.abort.signal;
    const minDelayMs = this.options.minDelayMs ?? 250;
    const maxDelayMs = this.options.maxDelayMs ?? 10_000;
    for (let failures = 0; !signal.aborted; failures++) {
      try {
        const states = await ensureTopics(kafka, topics, this.options.attemptTimeoutMs ?? 15_000, signal);
        if (signal.aborted) return;
        this.isReady = true;
        this.markReady();
        logger.info({ topics: states, attempts: failures + 1 }, 'Kafka topics ready');
        return;
      } catch (err) {
        if (signal.aborted) return;
        // The first failure is worth a warning; repeats while Kafka stays away are not news.
        const level = failures === 0 ? 'warn' : 'debug';
        logger[level](
          { err: toError(err), failures: failures + 1 },
          'cannot ensure Kafka topics yet; retrying',
        );
      }
      await sleep(Math.min(maxDelayMs, minDelayMs * 2 ** failures), undefined, { signal }).catch(
        () => undefined,
      );
    }
  }
}
