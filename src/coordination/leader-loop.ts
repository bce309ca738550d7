import { NotLeaderError, StaleFencingTokenError, toError } from '../errors.js';
import { loopBackoffMs } from '../loop-backoff.js';
import type { Logger } from '../observability/logger.js';
import type { LeaderLoopName } from '../observability/metric-labels.js';
import type { Metrics } from '../observability/metrics.js';
import type { Leadership } from './election.js';

/** Options of {@link runLeaderLoop}. */
export interface LeaderLoopOptions {
  /** The epoch the loop belongs to: it ends when the epoch's signal aborts. */
  readonly leadership: Leadership;
  /**
   * Names the loop in its log lines (`<name> rejected by the fence`, `<name> pass failed`) and in
   * helios_leader_pass_failures_total{loop}.
   */
  readonly name: LeaderLoopName;
  /**
   * One pass and the wait after it (on the epoch's signal). A pass throws NotLeaderError when the
   * epoch ended before it could write, StaleFencingTokenError when the fence rejected its write.
   */
  readonly pass: () => Promise<void>;
  /** Waits `ms` after a failed pass (a sleep, or a wake-up that may end it early). */
  readonly wait: (ms: number, signal: AbortSignal) => Promise<void>;
  /** Longest back-off after repeated failures. */
  readonly maxBackoffMs: number;
  /** Called when the fence rejected a write: a newer leader exists. */
  readonly onFenced: (err: StaleFencingTokenError) => void;
  readonly logger: Logger;
  readonly metrics: Metrics;
}

/**
 * The loop every fenced leader task runs (the dispatcher, the reaper): passes until the epoch
 * ends. A stale fencing token is counted and makes the node step down (a newer leader wrote);
 * leadership ending stops the loop quietly; any other failure backs off and tries again.
 * Never rejects.
 */
export async function runLeaderLoop(options: LeaderLoopOptions): Promise<void> {
  const { leadership, logger, name } = options;
  const signal = leadership.signal;
  let failures = 0;
  while (!signal.aborted) {
    try {
      await options.pass();
      failures = 0;
    } catch (err) {
      if (err instanceof StaleFencingTokenError) {
        options.metrics.fenceRejections.inc();
        logger.warn({ token: leadership.token.toString() }, `${name} rejected by the fence; stepping down`);
        options.onFenced(err);
        return;
      }
      if (err instanceof NotLeaderError || signal.aborted) return;
      failures += 1;
      options.metrics.leaderPassFailures.inc({ loop: name });
      logger.warn({ err: toError(err), failures }, `${name} pass failed; retrying`);
      await options.wait(loopBackoffMs(failures, options.maxBackoffMs), signal);
    }
  }
}
