/**
 * How long a background loop waits after its `failures`-th failure in a row: `baseMs × 2^failures`,
 * capped at `maxMs`. One rule for every loop (dispatcher, relay, reaper, pruner, poller, Kafka
 * intake), so an outage of a shared server makes them all back off alike and all come back
 * within `maxMs` of its return.
 */
export function loopBackoffMs(failures: number, maxMs: number, baseMs = 100): number {
  return Math.min(maxMs, baseMs * 2 ** Math.min(failures, 30));
}
