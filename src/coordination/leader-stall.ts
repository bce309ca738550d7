import { performance } from 'node:perf_hooks';
import type { Logger } from '../observability/logger.js';
import { toError } from '../errors.js';

/**
 * What the probe found: PostgreSQL answers and the leader's sessions are at work there (or it
 * answered with an error of its own), or it answers but none of them is.
 */
export type StallVerdict = 'answering' | 'sessions-lost';

/** The probe's verdict, and what the leader's sessions were doing there (logged as it is). */
export interface StallFinding {
  readonly verdict: StallVerdict;
  readonly atWork?: readonly object[];
}

/** Options of {@link LeaderStallWatch}. */
export interface LeaderStallWatchOptions {
  /** The epoch watched: the watch ends when it aborts. */
  readonly signal: AbortSignal;
  /** How long the leader may go without PostgreSQL answering a dispatch pass before it is probed. */
  readonly stallMs: number;
  /**
   * Asks PostgreSQL on a new connection (a statement the dispatcher waits for may sit on a
   * connection whose answers cannot come while the database answers everyone else): `answering`
   * when it answers and the leader's own sessions are at work there, `sessions-lost` when it
   * answers but none of them is; rejects when it cannot be reached within its own timeout.
   */
  readonly probe: () => Promise<StallFinding>;
  /**
   * Called once when the probe failed after a stall, or found the leader's sessions lost: this
   * node cannot use PostgreSQL.
   */
  readonly stepDown: (err: Error) => void;
  readonly logger: Logger;
}

/**
 * Watches one leader epoch's progress in PostgreSQL. The leader keeps its etcd lease while it
 * cannot use PostgreSQL (a partition between the two; its connections left waiting by a server
 * that moved, or by a firewall that forgot them): without this watch it would lead without
 * creating a run until its connections broke, and the occurrences meanwhile would be missed, then
 * handled as misfires. The dispatcher reports each pass PostgreSQL answered (`progressed`: it
 * committed, at least once a second while it leads, or the server refused it with an error of its
 * own, such as read-only, which every node would meet). When none has been answered for
 * `stallMs`, the watch asks PostgreSQL on a new connection. If that fails, or PostgreSQL answers
 * but none of the leader's own sessions is at work there, `stepDown` ends the epoch, so that a
 * node with working connections leads. A database that answers while the leader's sessions work
 * (a slow statement, a lock wait), or that answers with an error of its own (too many
 * connections), keeps its leader: another node would meet the same database, and stepping down
 * would only cost work.
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

  /** PostgreSQL answered a dispatch pass: it committed, or the server refused it itself. */
  progressed(): void {
    this.lastProgress = performance.now();
  }

  private giveUp(err: Error, stalledMs: number, message: string): void {
    this.done = true;
    clearInterval(this.timer);
    this.options.logger.warn({ err, stalledMs }, message);
    this.options.stepDown(err);
  }

  private async check(): Promise<void> {
    const { signal, stallMs, logger } = this.options;
    if (this.probing || this.done || signal.aborted) return;
    const stalledMs = Math.round(performance.now() - this.lastProgress);
    if (stalledMs < stallMs) return;
    this.probing = true;
    const askedAt = performance.now();
    // A dispatch that committed while the probe was out ended the stall: its verdict is stale
    // (the leader's sessions, at work when the stall was seen, may be idle by the time it looks).
    const stale = () => signal.aborted || this.lastProgress > askedAt;
    try {
      let finding: StallFinding;
      try {
        finding = await this.options.probe();
      } catch (err) {
        if (stale()) return;
        return this.giveUp(
          toError(err),
          stalledMs,
          'no dispatch pass answered within the stall limit and PostgreSQL cannot be reached; stepping down',
        );
      }
      if (stale()) return;
      if (finding.verdict === 'sessions-lost') {
        return this.giveUp(
          new Error("none of the leader pool's sessions is at work in PostgreSQL"),
          stalledMs,
          "no dispatch pass answered within the stall limit and PostgreSQL answers, but none of the leader's sessions is at work there: its connections are lost; stepping down",
        );
      }
      logger.warn(
        { stalledMs, atWork: finding.atWork },
        "no dispatch pass answered within the stall limit, but PostgreSQL answers and the leader's sessions are at work there; still leading",
      );
      // Look again one stall limit from now, not at every tick.
      this.lastProgress = performance.now();
    } finally {
      this.probing = false;
    }
  }
}
