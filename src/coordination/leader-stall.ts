import { performance } from 'node:perf_hooks';
import type { Logger } from '../observability/logger.js';
import { toError } from '../errors.js';

/** Options of {@link LeaderStallWatch}. */
export interface LeaderStallWatchOptions {
  /** The epoch watched: the watch ends when it aborts. */
  readonly signal: AbortSignal;
  /** How long the leader may go without committing a dispatch pass before PostgreSQL is probed. */
  readonly stallMs: number;
  /**
   * Opens a new connection to PostgreSQL and runs a statement on it; rejects when it cannot
   * within its own timeout. A new connection, because a statement the dispatcher waits for may
   * sit on a connection whose server vanished while the database answers everyone else.
   */
  readonly probe: () => Promise<void>;
  /** Called once when the probe failed after a stall: this node cannot reach PostgreSQL. */
  readonly onUnreachable: (err: Error) => void;
  readonly logger: Logger;
}

/**
 * Watches one leader epoch's progress in PostgreSQL. The leader keeps its etcd lease while it
 * cannot reach PostgreSQL (a partition between the two, a connection left waiting by a vanished
 * server): without this watch it would lead without creating a run until the connection broke,
 * and the occurrences meanwhile would be missed, then handled as misfires. The dispatcher reports
 * each pass it commits (`progressed`, at least once a second while it leads). When none has been
 * committed for `stallMs`, the watch asks PostgreSQL on a new connection: if that fails as well,
 * `onUnreachable` steps the node down, so that a node that can reach the database leads. A
 * database that answers, only slowly, keeps its leader: another node would meet the same database,
 * and a new leader ends its predecessor's transactions, so stepping down would only cost work.
 */
export class LeaderStallWatch {
  private lastProgress = performance.now();
  private probing = false;
  private done = false;
  private readonly timer: NodeJS.Timeout;

  constructor(private readonly options: LeaderStallWatchOptions) {
    const everyMs = Math.max(50, Math.min(250, Math.floor(options.stallMs / 4)));
    this.timer = setInterval(() => void this.check(), everyMs);
    this.timer.unref();
    options.signal.addEventListener('abort', () => clearInterval(this.timer), { once: true });
    if (options.signal.aborted) clearInterval(this.timer);
  }

  /** A dispatch pass committed. */
  progressed(): void {
    this.lastProgress = performance.now();
  }

  private async check(): Promise<void> {
    const { signal, stallMs, logger } = this.options;
    if (this.probing || this.done || signal.aborted) return;
    const stalledMs = Math.round(performance.now() - this.lastProgress);
    if (stalledMs < stallMs) return;
    this.probing = true;
    try {
      await this.options.probe();
      if (signal.aborted) return;
      logger.warn(
        { stalledMs },
        'no dispatch committed within the stall limit, but PostgreSQL answers a new connection; still leading',
      );
      // Look again one stall limit from now, not at every tick.
      this.lastProgress = performance.now();
    } catch (err) {
      if (signal.aborted) return;
      this.done = true;
      clearInterval(this.timer);
      const error = toError(err);
      logger.warn(
        { err: error, stalledMs },
        'no dispatch committed within the stall limit and PostgreSQL cannot be reached; stepping down',
      );
      this.options.onUnreachable(error);
    } finally {
      this.probing = false;
    }
  }
}
