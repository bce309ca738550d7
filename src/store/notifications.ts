import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import type { Logger } from '../observability/logger.js';
import { LifecycleError, toError, withTimeout } from '../errors.js';

/**
 * Channels that wake loops early; the loops still poll, so a lost notification only delays.
 * `helios_handoff` carries payloads (store/handoff.ts) to {@link Notifications.subscribe}rs.
 */
export type Channel = 'helios_jobs' | 'helios_outbox' | 'helios_runs' | 'helios_handoff';

/** Tuning of {@link Notifications}; the defaults suit a node. */
export interface NotificationsOptions {
  /**
   * Longest wait for a connection (TCP, TLS, startup and the LISTENs). Without it a server that
   * accepts and never answers (a partition, a black-holed address) would hold the loop, and
   * `stop()`, for ever. Default 5000 ms, as the pool's.
   */
  readonly connectTimeoutMs?: number;
  /** Pause between connection attempts. Default 500 ms. */
  readonly retryDelayMs?: number;
}

/**
 * One dedicated connection that LISTENs on our channels and reconnects when it breaks.
 * `wait(channel, ms, signal)` resolves after `ms`, or earlier on a notification or abort.
 */
export class Notifications {
  private client?: pg.Client;
  private readonly waiters = new Map<Channel, Set<() => void>>();
  /** Wake-ups per channel so far (notifications, reconnects, stop): see {@link seen}. */
  private readonly wakeUps = new Map<Channel, number>();
  private readonly subscribers = new Map<Channel, Set<(payload: string) => void>>();
  private readonly abort = new AbortController();
  private loop?: Promise<void>;
  private stopping?: Promise<void>;

  constructor(
    private readonly connectionString: string,
    private readonly channels: readonly Channel[],
    private readonly logger: Logger,
    private readonly options: NotificationsOptions = {},
  ) {}

  /** Connects (retrying in the background if PostgreSQL is down). */
  start(): void {
    if (this.loop) throw new LifecycleError('notifications already started');
    this.loop = this.connectLoop();
  }

  private async connectLoop(): Promise<void> {
    const signal = this.abort.signal;
    const connectTimeoutMs = this.options.connectTimeoutMs ?? 5000;
    // One abort listener for the life of the loop: one per connection would pile up on the
    // signal with every reconnect (a flapping server would leak them without bound).
    const aborted = new Promise<void>((resolve) =>
      signal.addEventListener('abort', () => resolve(), { once: true }),
    );
    while (!signal.aborted) {
      const client = new pg.Client({
        connectionString: this.connectionString,
        application_name: 'helios-listen',
        // pg's own timeout covers TCP, TLS and the startup exchange.
        connectionTimeoutMillis: connectTimeoutMs,
        // A connection that goes silent after it was set up is noticed by the OS, not never.
        keepAlive: true,
        keepAliveInitialDelayMillis: 10_000,
      });
      const ended = new Promise<void>((resolve) => {
        client.on('error', (err) => {
          this.logger.warn({ err }, 'LISTEN connection failed; reconnecting');
          resolve();
        });
        client.on('end', () => resolve());
      });
      try {
        // The LISTENs are bounded too, and an abort ends the attempt at once (the finally below
        // closes the half-open client).
        const ready = (async () => {
          await client.connect();
          client.on('notification', (msg) => {
            this.notify(msg.channel as Channel);
            if (msg.payload) this.deliver(msg.channel as Channel, msg.payload);
          });
          for (const channel of this.channels) await client.query(`LISTEN ${channel}`);
        })();
        ready.catch(() => undefined); // observed below; abandoned on timeout or abort
        await Promise.race([withTimeout(ready, connectTimeoutMs * 2, 'LISTEN connect'), aborted]);
        if (signal.aborted) break;
        this.client = client;
        // Anything that happened while we were not listening is picked up by a wake-up now.
        for (const channel of this.channels) this.notify(channel);
        await Promise.race([ended, aborted]);
      } catch (err) {
        if (!signal.aborted) this.logger.warn({ err: toError(err) }, 'LISTEN connect failed; retrying');
      } finally {
        this.client = undefined;
        // Bounded: ending a client whose socket is silent must not hold the loop either.
        await withTimeout(client.end(), 1000, 'LISTEN disconnect').catch(() => undefined);
      }
      await sleep(this.options.retryDelayMs ?? 500, undefined, { signal }).catch(() => undefined);
    }
  }

  private notify(channel: Channel): void {
    this.wakeUps.set(channel, this.seen(channel) + 1);
    const set = this.waiters.get(channel);
    if (!set) return;
    this.waiters.delete(channel);
    for (const wake of set) wake();
  }

  /**
   * Calls `handler` with the payload of each notification on `channel` received while connected
   * (none are replayed after a reconnect: a payload is a hint, never the only way). Returns the
   * unsubscribe function. The channel must be one this instance LISTENs on.
   */
  subscribe(channel: Channel, handler: (payload: string) => void): () => void {
    let set = this.subscribers.get(channel);
    if (!set) this.subscribers.set(channel, (set = new Set()));
    set.add(handler);
    return () => set.delete(handler);
  }

  private deliver(channel: Channel, payload: string): void {
    for (const handler of this.subscribers.get(channel) ?? []) {
      try {
        handler(payload);
      } catch (err) {
        this.logger.warn({ err: toError(err), channel }, 'notification handler failed');
      }
    }
  }

  /**
   * How many wake-ups `channel` has had: a loop reads it before it looks at the database and
   * passes it to {@link wait}, so a notification that came while it looked is not lost.
   */
  seen(channel: Channel): number {
    return this.wakeUps.get(channel) ?? 0;
  }

  /**
   * Sleeps up to `ms`; returns early on a notification on `channel` or when `signal` aborts, and at
   * once when `since` (a {@link seen} reading) is behind: a notification came since it was read.
   */
  async wait(channel: Channel, ms: number, signal: AbortSignal, since?: number): Promise<void> {
    if (signal.aborted || ms <= 0) return;
    if (since !== undefined && since !== this.seen(channel)) return;
    let wake!: () => void;
    const woken = new Promise<void>((resolve) => (wake = resolve));
    let set = this.waiters.get(channel);
    if (!set) this.waiters.set(channel, (set = new Set()));
    set.add(wake);
    // Not AbortSignal.any([signal, timer]): a composite per wait on the long-lived stop signal is
    // the pattern Node.js has leaked memory on (nodejs/node#54614, #64481); a listener removed in
    // `finally` cannot leak.
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
