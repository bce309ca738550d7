import { setTimeout as sleep } from 'node:timers/promises';
import type { Etcd3, Lease } from 'etcd3';
import type { Logger } from '../observability/logger.js';
import { LifecycleError, toError, withTimeout } from '../errors.js';

/** What a node publishes about itself under `<prefix>/nodes/<id>`. */
export interface NodeInfo {
  readonly id: string;
  readonly host: string;
  readonly pid: number;
  readonly apiUrl: string | null;
  readonly roles: readonly string[];
  readonly startedAt: string;
  readonly lastSeen: string;
}

export interface NodeRegistryOptions {
  readonly client: Etcd3;
  readonly prefix: string;
  readonly info: Omit<NodeInfo, 'lastSeen' | 'startedAt'>;
  /** TTL of the registration lease; a crashed node disappears after it. Default 10 s. */
  readonly ttlSeconds?: number;
  /** How often `lastSeen` is refreshed; default 5 s. */
  readonly refreshMs?: number;
  /** First retry after a failed registration (doubling up to `refreshMs`); default 250 ms. */
  readonly retryMs?: number;
  readonly logger: Logger;
}

type State = 'idle' | 'running' | 'stopping' | 'stopped';

/** Keeps this node's entry in etcd under a lease; re-registers after the lease is lost. */
export class NodeRegistry {
  private state: State = 'idle';
  private readonly abort = new AbortController();
  private loop: Promise<void> = Promise.resolve();
  private stopping?: Promise<void>;
  private lease?: Lease;
  private readonly startedAt = new Date().toISOString();

  constructor(private readonly options: NodeRegistryOptions) {}

  private get key() {
    return `${this.options.prefix}/nodes/${this.options.info.id}`;
  }

  /** True while the last registration attempt succeeded. */
  get registered(): boolean {
    return this.isRegistered;
  }
  private isRegistered = false;

  /**
   * Tries to register once (so a started node is visible at once), then keeps the entry fresh.
   * Never fails for etcd being away: a node must start while etcd is down (its API and worker do
   * not need etcd), so the first registration is then retried in the background with back-off.
   */
  async start(): Promise<void> {
    if (this.state !== 'idle') throw new LifecycleError(`registry is ${this.state}`);
    this.state = 'running';
    await this.attempt(0);
    this.loop = this.refreshLoop();
  }

  /** One registration; failures are logged (the first as a warning), never thrown. */
  private async attempt(failures: number): Promise<boolean> {
    try {
      await this.register();
      if (failures > 0) this.options.logger.info({ failures }, 'node registered after retries');
      this.isRegistered = true;
      return true;
    } catch (err) {
      if (this.abort.signal.aborted) return false;
      this.isRegistered = false;
      const level = failures === 0 ? 'warn' : 'debug';
      this.options.logger[level](
        { err: toError(err), failures: failures + 1 },
        'node registration failed; retrying in the background',
      );
      return false;
    }
  }

  private async register(): Promise<void> {
    const { client, ttlSeconds = 10, logger } = this.options;
    if (!this.lease || this.lease.revoked()) {
      const lease = client.lease(ttlSeconds);
      lease.on('lost', (err) => {
        // A grant that failed while etcd is away is reported by attempt(); only a lease that
        // held our entry is news.
        logger[this.isRegistered ? 'warn' : 'debug']({ err }, 'node registration lease lost; re-registering');
        if (this.lease === lease) this.lease = undefined;
      });
      this.lease = lease;
    }
    const value: NodeInfo = {
      ...this.options.info,
      startedAt: this.startedAt,
      lastSeen: new Date().toISOString(),
    };
    await withTimeout(
      this.lease.put(this.key).value(JSON.stringify(value)).exec(),
      3000,
      'etcd node registration',
    );
  }

  private async refreshLoop(): Promise<void> {
    const signal = this.abort.signal;
    const refreshMs = this.options.refreshMs ?? 5000;
    const retryMs = this.options.retryMs ?? 250;
    let failures = this.isRegistered ? 0 : 1;
    while (!signal.aborted) {
      // While etcd is away, retry sooner than the refresh period (a node coming back from an etcd
      // outage should reappear in the cluster view quickly), backing off up to that period.
      const delay = failures === 0 ? refreshMs : Math.min(refreshMs, retryMs * 2 ** (failures - 1));
      try {
        await sleep(delay, undefined, { signal });
      } catch {
        return;
      }
      failures = (await this.attempt(failures)) ? 0 : failures + 1;
    }
  }

  /** Removes the entry (revoking its lease) so the node disappears at once. Safe to call twice. */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      this.state = 'stopping';
      this.abort.abort();
      await this.loop;
      try {
        await withTimeout(this.lease?.revoke() ?? Promise.resolve(), 2000, 'etcd lease revoke');
      } catch (err) {
        this.options.logger.warn(
          { err: toError(err) },
          'could not revoke the registration lease; it will expire',
        );
      }
      this.state = 'stopped';
    })();
    return this.stopping;
  }
}

/** Lists live nodes from etcd. */
export async function listNodes(client: Etcd3, prefix: string): Promise<NodeInfo[]> {
  const entries = await client.getAll().prefix(`${prefix}/nodes/`).strings();
  return Object.values(entries)
    .map((raw) => JSON.parse(raw) as NodeInfo)
    .sort((a, b) => a.id.localeCompare(b.id));
}
