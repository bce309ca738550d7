import { performance } from 'node:perf_hooks';
import { databaseEpochMs, type Queryable } from '../store/db.js';

/**
 * This process's estimate of the database clock, the one clock for scheduling decisions.
 * A worker holds a run until its `not_before` by *this* clock, so a node whose own clock is off
 * still fires on time. The offset is sampled NTP-style (midpoint of the round trip, best of a few
 * samples): its error is at most half the round trip, well inside the claim's skew tolerance.
 * Between samples the estimate runs on the monotonic clock (`performance.now()`), not on the
 * wall clock: a step of this host's wall clock (an NTP correction, a VM resumed) does not move
 * it, only the two clocks' drift does (parts per million over the seconds between samples).
 */
export class DbClock {
  /** Database time minus the monotonic clock, in ms; until the first sample, the wall clock's. */
  private offsetMs: number;
  private lastSync = -Infinity;

  private readonly monotonic: () => number;

  /** `monotonic`: ms from an origin of its own that never steps (tests with mocked timers pass theirs). */
  constructor(monotonic?: () => number) {
    this.monotonic = monotonic ?? (() => performance.now());
    // performance.timeOrigin is the wall clock at performance.now()'s origin, to the microsecond
    // (Date.now() is to the millisecond: the estimate would start up to 1 ms behind).
    this.offsetMs = monotonic ? Date.now() - monotonic() : performance.timeOrigin;
  }

  /** Database time now, in ms since the epoch, as estimated locally. */
  now(): number {
    return this.monotonic() + this.offsetMs;
  }

  /** Milliseconds from now until `instant` (database time); negative when past. */
  msUntil(instant: Date): number {
    return instant.getTime() - this.now();
  }

  /** Current estimate of (database clock − this host's wall clock), in ms. */
  get offset(): number {
    return this.now() - Date.now();
  }

  /** Re-samples the offset if the last sample is older than `maxAgeMs`; errors propagate. */
  async sync(db: Queryable, maxAgeMs = 0, samples = 3): Promise<void> {
    if (this.monotonic() - this.lastSync < maxAgeMs) return;
    let best: { rtt: number; offset: number } | undefined;
    for (let i = 0; i < samples; i++) {
      const t0 = this.monotonic();
      const dbMs = await databaseEpochMs(db);
      const rtt = this.monotonic() - t0;
      if (dbMs === undefined) continue;
      const offset = dbMs - (t0 + rtt / 2);
      if (!best || rtt < best.rtt) best = { rtt, offset };
    }
    if (best) this.offsetMs = best.offset;
    this.lastSync = this.monotonic();
  }
}
