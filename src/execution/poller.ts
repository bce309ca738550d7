import { setTimeout as sleep } from 'node:timers/promises';
import { toError } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { Metrics } from '../observability/metrics.js';
import type { ClaimedRun } from '../store/runs.js';
import { loopBackoffMs } from '../loop-backoff.js';

/** Options of {@link pollOverdue}. */
export interface PollerOptions {
  /**
   * Claims up to `limit` queued runs at least `overdueMs` overdue, in one transaction
   * (store/overdue.ts claimOverdueRuns); `skipped` counts fresh `forbid` occurrences skipped,
   * `misfired` the misfires their jobs' policies drop.
   */
  readonly claimOverdue: (
    overdueMs: number,
    limit: number,
  ) => Promise<{ claimed: ClaimedRun[]; skipped: number; misfired: number }>;
  /** Re-samples the worker's estimate of the database clock when it is older than `maxAgeMs`. */
  readonly syncClock: (maxAgeMs: number) => Promise<void>;
  /** Time between polls. */
  readonly intervalMs: number;
  /** A queued run is taken once it is this late: its message should have arrived long before. */
  readonly overdueMs: number;
  /** Execution slots free now; the poller claims at most this many. */
  readonly capacity: () => number;
  /** Reserves `n` slots while a poll is claiming (so nothing else takes them meanwhile). */
  readonly reserve: (n: number) => () => void;
  /**
   * Takes the claimed runs into the slots reserved for them (before the reservation ends), or,
   * `inReservedSlots` false, the reservation having lapsed (see reservationMaxMs), into the queue
   * for slots that runs claimed from announcements wait in.
   */
  readonly execute: (runs: ClaimedRun[], inReservedSlots: boolean) => void;
  /** A poll not answered within this holds its reservation no longer; default POLL_RESERVATION_MAX_MS. */
  readonly reservationMaxMs?: number;
  readonly logger: Logger;
  readonly metrics: Metrics;
  readonly signal: AbortSignal;
}

/** The database clock offset is re-sampled this often. */
const CLOCK_SYNC_MS = 30_000;

/**
 * How long a poll's reservation of the free slots lasts at most. A poll answers in a few ms; one
 * that does not (a statement left waiting on a connection that went silent, a database in
 * trouble) held every free slot of the worker for as long as it waited, up to the query read
 * timeout: runs claimed from announcements meanwhile waited out their claims uncalled, and the
 * reaper's forgiven expiries and then their attempts ran out (leader-stall-review-blackhole:
 * occurrences dead after PostgreSQL came back). Past this, the slots are given back, and the
 * poll's claims, when they come, wait for slots as announced runs do.
 */
export const POLL_RESERVATION_MAX_MS = 250;

/**
 * The polling fallback (contract item 5): claims queued runs whose message is overdue, with
 * FOR UPDATE SKIP LOCKED so pollers on several nodes take disjoint runs. With Kafka down, or a
 * message lost with a crashed worker, runs still execute, `overdueMs` to `overdueMs + intervalMs`
 * late. Also keeps the worker's estimate of the database clock fresh. Never rejects.
 */
export async function pollOverdue(options: PollerOptions): Promise<void> {
  const { logger, metrics, signal } = options;
  let failures = 0;
  while (!signal.aborted) {
    try {
      await options.syncClock(CLOCK_SYNC_MS);
      const capacity = options.capacity();
      if (capacity > 0) {
        const release = options.reserve(capacity);
        let lapsed = false;
        const lapse = setTimeout(() => {
          lapsed = true;
          release();
        }, options.reservationMaxMs ?? POLL_RESERVATION_MAX_MS);
        let claimed: ClaimedRun[] = [];
        let misfired = 0;
        try {
          const result = await options.claimOverdue(options.overdueMs, capacity);
          claimed = result.claimed;
          misfired = result.misfired;
          if (result.skipped > 0) metrics.runsSkipped.inc({ reason: 'concurrency-forbid' }, result.skipped);
          if (misfired > 0) metrics.runsSkipped.inc({ reason: 'misfire' }, misfired);
          // The claimed runs take their slots before the reservation is given back: released
          // first, the slots went to announced runs that fell due meanwhile, and these ran on top.
          if (claimed.length > 0) options.execute(claimed, !lapsed);
        } finally {
          clearTimeout(lapse);
          release();
        }
        if (misfired > 0) logger.info({ runs: misfired }, "skipped misfires by their jobs' policies");
        if (claimed.length > 0) {
          metrics.runClaims.inc({ source: 'poll', result: 'claimed' }, claimed.length);
          logger.info({ runs: claimed.length }, 'claimed overdue runs by polling');
        }
        // A full batch means more may be waiting: poll again without sleeping.
        if (claimed.length + misfired === capacity) continue;
      }
      failures = 0;
    } catch (err) {
      if (signal.aborted) return;
      failures += 1;
      logger.warn({ err: toError(err), failures }, 'overdue poll failed; retrying');
    }
    const wait = failures === 0 ? options.intervalMs : loopBackoffMs(failures, 10_000, options.intervalMs);
    await sleep(wait, undefined, { signal }).catch(() => undefined);
  }
}
