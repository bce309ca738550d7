/**
 * What the chaos checker accepts, shared by the chaos run (run.ts) and the live checker test
 * (checker-live.test.ts), so both judge by the same bounds.
 */
import { DEFAULT_CLAIM_LEAD_MS, DEFAULT_DISPATCH_LOOKAHEAD_MS } from '../../src/config/index.js';
import type { Settings } from './observations.js';

/** The nodes' leader lease TTL (HELIOS_LEASE_TTL_MS, the default). */
export const TTL_MS = 3000;
/** The nodes' HELIOS_CLAIM_GRACE_MS. */
export const CLAIM_GRACE_MS = 3000;
/** The nodes' HELIOS_CLAIM_LEAD_MS (the default's value). */
export const CLAIM_LEAD_MS = DEFAULT_CLAIM_LEAD_MS;
/** The nodes' HELIOS_REAPER_INTERVAL_MS (the default). */
export const REAPER_INTERVAL_MS = 1000;

/**
 * Lateness bounds (first call − scheduled_for, by the fault whose window the occurrence was due
 * in) are the worst we measured on the shared 2-core machine (load average up to 24) plus a
 * margin; Helios promises no lateness bound (README), so these only catch a run that waited far
 * longer than any recovery takes. A fault kind without a bound gets `default`.
 */
export function chaosSettings(settleMs: number): Settings {
  return {
    misfireThresholdMs: 5000,
    lookaheadMs: DEFAULT_DISPATCH_LOOKAHEAD_MS,
    claimGraceMs: CLAIM_GRACE_MS,
    claimLeadMs: CLAIM_LEAD_MS,
    reaperIntervalMs: REAPER_INTERVAL_MS,
    leaseTtlMs: TTL_MS,
    opToleranceMs: 500,
    earlyToleranceMs: 25,
    settleMs,
    latenessBoundMs: {
      'no fault': 2500, // measured worst 1.7 s
      'cut-leader-from-etcd': 5000, // 1.7 s
      'kill-worker-mid-call': 7000, // 3.2 s
      // A stopping node's held runs are called by it while their call fits in its drain, else
      // handed back or left to the other nodes' polling fallback (2 s overdue). Not yet measured
      // widely: the kill's bound plus a margin.
      'sigterm-leader': 10_000,
      'sigterm-worker-mid-call': 10_000,
      'pause-leader': 8000, // 3.7 s
      // While Kafka is down every run waits for the polling fallback (claims once 2 s overdue); on a
      // load average of 29 that reached 17.3 s. A run that waited for Kafka itself to come back
      // (113 s that time) is what this bound catches.
      'restart-kafka': 20_000,
      'restart-postgres': 8000, // 4.1 s
      // Nothing runs while PostgreSQL is away (README, "Not promised"): a run due as the outage began
      // waits for all of it, then for the claim and the call (34.5 s measured, seed 11).
      'postgres-down-30s': 45_000,
      'restart-etcd': 10_000, // 5.2 s
      'kill-leader': 12_000, // 8.6 s
      default: 15_000,
    },
  };
}
