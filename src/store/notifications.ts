import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import type { Logger } from '../observability/logger.js';
import { LifecycleError, toError } from '../errors.js';

/** Channels that wake loops early; the loops still poll, so a lost notification only delays. */
export type Channel = 'helios_jobs' | 'helios_outbox' | 'helios_runs';

/**
 * One dedicated connection that LISTENs on our channels and reconnects when it breaks.
 * `wait(channel, ms, signal)` resolves after `ms`, or earlier on a notification or abort.
 */
export class Notifications {
  private client?: pg.Client;
  private readonly waiters = new Map<Channel, Set<() => void>>();
  private readonly abort = new AbortController();
  private loop?: Promise<void>;
  private stopping?: Promise<void>;

  constructor(
    private readonly connectionString: string,
    private readonly channels: readonly Channel[],
    private readonly logger: Logger,
  ) {}

  /** Connects (retrying in the background if PostgreSQL is down). */
  start(): void {
    if (this.loop) throw new LifecycleError('notifications already started');
    this.loop = this.connectLoop();
  }

  private async connectLoop(): Promise<void> {
    const signal = this.abort.signal;
    while (!signal.aborted) {
      const client = new pg.Client({
        connectionString: this.connectionString,
        application_name: 'helios-listen',
      });
      const ended = new Promise<void>((resolve) => {
        client.on('error', (err) => {
          this.logger.warn({ err }, 'LISTEN connection failed; reconnecting');
          resolve();
        });
        client.on('end', () => resolve());
      });
      try {
        await client.connect();
        client.on('notification', (msg) => this.notify(msg.channel as Channel));
        for (const channel of this.channels) await client.query(`LISTEN ${channel}`);
        this.client = client;
        // Anything that happened while we were not listening is picked up by a wake-up now.
        for (const channel of this.channels) this.notify(channel);
        await Promise.race([ended, new Promise((resolve) => signal.addEventListener('abort', resolve))]);
      } catch (err) {
        if (!signal.aborted) this.logger.warn({ err: toError(err) }, 'LISTEN connect failed; retrying');
      } finally {
        this.client = undefined;
        await client.end().catch(() => undefined);
      }
      await sleep(500, undefined, { signal }).catch(() => undefined);
    }
  }

  private notify(channel: Channel): void {
    const set = this.waiters.get(channel);
    if (!set) return;
    this.waiters.delete(channel);
    for (const wake of set) wake();
  }

  /** Sleeps up to `ms`; returns early on a notification on `channel` or when `signal` aborts. */
  async wait(channel: Channel, ms: number, signal: AbortSignal): Promise<void> {
    if (signal.aborted || ms <= 0) return;
    let wake!: () => void;
    const woken = new Promise<void>((resolve) => (wake = resolve));
    let set = this.waiters.get(channel);
    if (!set) this.waiters.set(channel, (set = new Set()));
    set.add(wake);
    const timer = new AbortController();
    const onAbort = () => wake();
    signal.addEventListener('abort', onAbort, { once: true });
    try {
      await Promise.race([woken, sleep(ms, undefined, { signal: timer.signal }).catch(() => undefined)]);
    } finally {
      timer.abort();
      signal.removeEventListener('abort', onAbort);
      this.waiters.get(channel)?.delete(wake);
    }
  }

  /** Stops listening and closes the connection. Safe to call twice. */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      this.abort.abort();
      for (const channel of this.channels) this.notify(channel);
      await this.loop;
    })();
    return this.stopping;
  }
}
