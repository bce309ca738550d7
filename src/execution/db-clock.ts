import { performance } from 'node:perf_hooks';
import { databaseEpochMs, withClient, type Queryable } from '../store/db.js';
import type { Connections } from '../store/pool-share.js';

/**
 * How far this host's wall clock and monotonic clock may drift apart since a sample before the
 * estimate is re-sampled at the next sync, whatever its age: one of them stepped or stopped.
 */
const CLOCKS_DISAGREE_MS = 50;

/**
 * A sample's answer is waited for this long at most (see CheckoutOptions.readTimeoutMs): one
 * whose round trip took longer is worth nothing (its error is up to half of it), and every caller
 * of sync() shares the sampling in progress, the poller's loop among them: left waiting on a
 * connection that went silent, it held them all for the pool's query read timeout (35 s).
 */
const SAMPLE_READ_TIMEOUT_MS = 2000;

/**
 * This process's estimate of the database clock, the one clock for scheduling decisions.
 * A worker holds a run until its `not_before` by *this* clock, so a node whose own clock is off
 * still fires on time. The offset is sampled NTP-style (midpoint of the round trip, best of a few
 * samples, on one connection checked out first): its error is at most half the round trip, well
 * inside the claim's skew tolerance.
 *
 * Between samples it runs on both of this host's clocks, which fail differently: the wall clock
 * steps (an NTP correction), the monotonic clock stops while the host is suspended. While they
 * agree either will do; once they disagree, a due time is judged by the earlier estimate (a run
 * is never called early for a clock that jumped ahead) and a claim's remaining time by the later
 * one (a call is never begun on time the claim no longer has), until the next sync re-samples.
 */
export class DbClock {
  /** Database time minus the monotonic clock, and minus the wall clock, in ms. */
  private monotonicOffsetMs: number;
  private wallOffsetMs = 0;
  private lastSync = -Infinity;
  /** The sampling in progress, if any (see sync). */
  private sampling: Promise<void> | undefined;
  private readonly monotonic: () => number;

  /** `monotonic`: ms from an origin of its own that never steps (tests with mocked timers pass theirs). */
  constructor(monotonic?: () => number) {
    this.monotonic = monotonic ?? (() => performance.now());
    // Until the first sample, the wall clock. performance.timeOrigin is the wall clock at
    // performance.now()'s origin, to the microsecond (Date.now() is to the millisecond).
    this.monotonicOffsetMs = monotonic ? Date.now() - monotonic() : performance.timeOrigin;
  }

  /** Database time now, in ms since the epoch, as estimated locally (the earlier estimate). */
  now(): number {
    return Math.min(this.monotonic() + this.monotonicOffsetMs, Date.now() + this.wallOffsetMs);
  }

  /** Milliseconds from now until `instant` (database time); negative when past. For due times. */
  msUntil(instant: Date): number {
    return instant.getTime() - this.now();
  }

  /** Database time now by the later estimate (the same as now() while the clocks agree). */
  latestNow(): number {
    return Math.max(this.monotonic() + this.monotonicOffsetMs, Date.now() + this.wallOffsetMs);
  }

  /** Milliseconds left until the deadline `instant` by the later estimate. For claims' deadlines. */
  msLeftUntil(instant: Date): number {
    return instant.getTime() - this.latestNow();
  }

  /** Current estimate of (database clock − this host's wall clock), in ms. */
  get offset(): number {
    return this.now() - Date.now();
  }

  /** True when the two clocks have drifted apart since the last sample (see CLOCKS_DISAGREE_MS). */
  get disagreeing(): boolean {
    const byMonotonic = this.monotonic() + this.monotonicOffsetMs;
    const byWall = Date.now() + this.wallOffsetMs;
    return Math.abs(byMonotonic - byWall) > CLOCKS_DISAGREE_MS;
  }

  /**
   * Re-samples the offsets if the last sample is older than `maxAgeMs` (by the monotonic clock)
   * or the clocks disagree; errors propagate.
   */
  async sync(db: Queryable | Connections, maxAgeMs = 0, samples = 3): Promise<void> {
    if (this.monotonic() - this.lastSync < maxAgeMs && !this.disagreeing) return;
    // One sampling at a time: callers that ask meanwhile (a herd's runs) share it.
    this.sampling ??= (
      isPool(db)
        ? withClient(db, (client) => this.sample(client, samples), undefined, {
            readTimeoutMs: SAMPLE_READ_TIMEOUT_MS,
          })
        : this.sample(db, samples)
    ).finally(() => (this.sampling = undefined));
    return this.sampling;
  }

  private async sample(db: Queryable, samples: number): Promise<void> {
    let best: { rtt: number; monotonicOffset: number; wallOffset: number } | undefined;
    for (let i = 0; i < samples; i++) {
      const t0 = this.monotonic();
      const wall0 = Date.now();
      const dbMs = await databaseEpochMs(db);
      const rtt = this.monotonic() - t0;
      if (dbMs === undefined) continue;
      const sample = { rtt, monotonicOffset: dbMs - (t0 + rtt / 2), wallOffset: dbMs - (wall0 + rtt / 2) };
      if (!best || rtt < best.rtt) best = sample;
    }
    if (best) {
      this.monotonicOffsetMs = best.monotonicOffset;
      this.wallOffsetMs = best.wallOffset;
    }
    this.lastSync = this.monotonic();
  }
}

/**
 * A pool (not a checked-out client): sampled on one client checked out first. Through the pool,
 * each sample's round trip included the wait for a connection, before the database read its
 * clock: the midpoint put the estimate ahead by half that wait. A worker whose pool stayed
 * saturated (a herd, a slow database) took every sample so; waits past twice the claim grace (5 s
 * by default, 100 ms at least) put it ahead by more than the grace, and every claim it made until
 * the next sample was handed back as too late (attempt.ts claim-too-late).
 */
function isPool(db: Queryable | Connections): db is Connections {
  return 'connect' in db && typeof db.connect === 'function' && !('release' in db);
}
