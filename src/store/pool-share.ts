import type pg from 'pg';
import { withClient } from './db.js';

/** What work on a pool needs: single queries and transactions (see inTransaction). */
export type Connections = Pick<pg.Pool, 'query' | 'connect'>;

/** Checked-out connections of a pool or share, and callers waiting for one. */
export interface PoolStats {
  readonly inUse: number;
  readonly waiting: number;
  readonly size: number;
}

/** Live counts of a pg pool (pg keeps them; reading them costs nothing). */
export function poolStats(pool: pg.Pool, size: number): PoolStats {
  return {
    get inUse() {
      return pool.totalCount - pool.idleCount;
    },
    get waiting() {
      return pool.waitingCount;
    },
    size,
  };
}

/**
 * At most `limit` connections of a pool used at once through this share; further callers wait in
 * order. The worker's runs go through one, so a herd of attempts settling at the same moment (a
 * burst of failing calls, each writing its retry) queues here instead of taking every connection
 * of the pool: the API and the readiness probe keep theirs. Queries and transactions run on the
 * pool itself; the share only counts them. Nothing may hold a connection of the share while it
 * asks the share for another (that could wait forever); inTransaction never does.
 */
export class PoolShare implements Connections, PoolStats {
  private active = 0;
  private readonly queue: (() => void)[] = [];

  constructor(
    private readonly pool: pg.Pool,
    readonly size: number,
  ) {
    if (!Number.isInteger(size) || size < 1) throw new RangeError(`share size must be >= 1, got ${size}`);
  }

  get inUse(): number {
    return this.active;
  }

  get waiting(): number {
    return this.queue.length;
  }

  // On a client of the share's own (withClient), not the pool's query: a statement whose answer
  // is given up on is then cancelled before its slot is freed (db.ts cancelStatement).
  readonly query = (async (...args: unknown[]) =>
    withClient(this, (client) =>
      (client.query as (...a: unknown[]) => Promise<unknown>).apply(client, args),
    )) as pg.Pool['query'];

  readonly connect = (async () => {
    const release = await this.acquire();
    let client: pg.PoolClient;
    try {
      client = await this.pool.connect();
    } catch (err) {
      release();
      throw err;
    }
    // pg-pool gives each checkout its own release function; this one also frees the slot, once.
    const giveBack = client.release;
    client.release = (err?: Error | boolean) => {
      client.release = giveBack;
      release();
      giveBack.call(client, err);
    };
    return client;
  }) as pg.Pool['connect'];

  private async acquire(): Promise<() => void> {
    if (this.active < this.size) {
      this.active += 1;
    } else {
      // The slot is handed over by the releaser: `active` stays counted for the waiter.
      await new Promise<void>((resolve) => this.queue.push(resolve));
    }
    let released = false;
    return () => {
      if (released) return;
      released = true;
      const next = this.queue.shift();
      if (next) next();
      else this.active -= 1;
    };
  }
}
