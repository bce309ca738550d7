import { performance } from 'node:perf_hooks';
import { silentLogger, type Logger } from './logger.js';

type Level = 'info' | 'warn' | 'error';
const SEVERITY: Readonly<Record<Level, number>> = { info: 0, warn: 1, error: 2 };

/** One run's log lines, let through by a {@link RunLines} budget. */
export interface RunLog {
  info(fields: object, msg: string): void;
  info(msg: string): void;
  warn(fields: object, msg: string): void;
  warn(msg: string): void;
  error(fields: object, msg: string): void;
  error(msg: string): void;
}

/**
 * Lines about single runs (a failed attempt, a run recovered, a claim lost) at most `perSecond`
 * a second on this node (HELIOS_LOG_RUN_LINES_PER_SECOND; 0: no limit). Past that each is
 * counted by its message and left out, and when the second is over one line says how many of
 * each were left out, at the level of the most severe of them. A target that goes down under a
 * herd fails thousands of attempts in a second: a line each is a burst that the log pipeline pays
 * for, that no one reads, and whose writing (≈35 µs a line) competes with the runs for the CPU.
 * Every attempt is still recorded in its run's history and counted by the metrics.
 */
export class RunLines {
  private windowEndsAt = 0;
  private used = 0;
  private readonly leftOut = new Map<string, number>();
  private leftOutLevel: Level = 'info';
  private timer: NodeJS.Timeout | undefined;

  constructor(
    /** Where the lines saying what was left out go. */
    private readonly logger: Logger,
    readonly perSecond: number,
  ) {
    if (!Number.isInteger(perSecond) || perSecond < 0) {
      throw new RangeError(`lines per second must be an integer >= 0, got ${perSecond}`);
    }
  }

  /**
   * A logger for one run's lines: a child of `parent` with `bindings`, made when its first line
   * gets through (a child logger per run is measurable at a few hundred runs a second).
   */
  forRun(parent: Logger, bindings: () => Record<string, unknown>): RunLog {
    let child: Logger | undefined;
    const line =
      (level: Level) =>
      (fieldsOrMsg: object | string, msg?: string): void => {
        const text = typeof fieldsOrMsg === 'string' ? fieldsOrMsg : (msg ?? '');
        if (!this.allow(level, text)) return;
        child ??= parent.child(bindings());
        if (typeof fieldsOrMsg === 'string') child[level](fieldsOrMsg);
        else child[level](fieldsOrMsg, msg);
      };
    return { info: line('info'), warn: line('warn'), error: line('error') } as RunLog;
  }

  /** Whether a line with this message may be written now; if not, it is counted as left out. */
  allow(level: Level, msg: string): boolean {
    if (this.perSecond === 0) return true;
    const now = performance.now();
    if (now >= this.windowEndsAt) {
      this.windowEndsAt = now + 1000;
      this.used = 0;
    }
    if (this.used < this.perSecond) {
      this.used += 1;
      return true;
    }
    this.leftOut.set(msg, (this.leftOut.get(msg) ?? 0) + 1);
    if (SEVERITY[level] > SEVERITY[this.leftOutLevel]) this.leftOutLevel = level;
    // Unreferenced: what a process that is exiting left out is said by stop(), not waited for.
    this.timer ??= setTimeout(() => this.flush(), this.windowEndsAt - now).unref();
    return false;
  }

  /** Logs now what was left out since the last such line (at the end of each second, and on stop). */
  flush(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    if (this.leftOut.size === 0) return;
    const leftOut = Object.fromEntries(this.leftOut);
    let count = 0;
    for (const n of this.leftOut.values()) count += n;
    const level = this.leftOutLevel;
    this.leftOut.clear();
    this.leftOutLevel = 'info';
    this.logger[level](
      { leftOut, perSecond: this.perSecond },
      `${count} lines about single runs left out (more than HELIOS_LOG_RUN_LINES_PER_SECOND)`,
    );
  }
}

/** No limit: every line is written (for parts given no budget; it never writes a line of its own). */
export const NO_RUN_LINE_LIMIT = new RunLines(silentLogger, 0);
