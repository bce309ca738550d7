import { performance } from 'node:perf_hooks';
import { databaseEpochMs, type Queryable } from '../store/db.js';

/**
 * This process's estimate of the database clock, the one clock for scheduling decisions.
 * A worker holds a run until its `not_before` by *this* clock, so a node whose own clock is off
 * still fires on time. The offset is sampled NTP-style (midpoint of the round trip, best of a few
 * samples): its error is at most half the round trip, well inside the claim's skew tolerance.
 */
export class DbClock {
  private offsetMs = 0;
  private lastSync = -Infinity;

  /** Database time now, in ms since the epoch, as estimated locally. */
  now(): number {
    return Date.now() + this.offsetMs;
  }

  /** Milliseconds from now until `instant` (database time); negative when past. */
  msUntil(instant: Date): number {
    return instant.getTime() - this.now();
  }

  /** Current estimate of (database clock − local clock), in ms. */
  get offset(): number {
    return this.offsetMs;
  }

  /** Re-samples the offset if the last sample is older than `maxAgeMs`; errors propagate. */
  async sync(db: Queryable, maxAgeMs = 0, samples = 3): Promise<void> {
    if (performance.now() - this.lastSync < maxAgeMs) return;
    let best: { rtt: number; offset: number } | undefined;
    for (let i = 0; i < samples; i++) {
      const before = Date.now();
      const t0 = performance.now();
      const dbMs = await databaseEpochMs(db);
      const rtt = performance.now() - t0;
      if (dbMs === undefined) continue;
      const offset = dbMs - (before + rtt / 2);
      if (!best || rtt < best.rtt) best = { rtt, offset };
    }
    if (best) this.offsetMs = best.offset;
    this.lastSync = performance.now();
  }
}
