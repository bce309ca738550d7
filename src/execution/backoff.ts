/** A run's retry settings (snapshot of the job's `retry`). */
export interface RetryPolicy {
  /** Delay before the second attempt, in ms. */
  readonly backoffMs: number;
  /** Each further delay is the previous one times this (>= 1). */
  readonly backoffMultiplier: number;
}

/** No delay grows past a day (the schema's largest backoffMs), however many attempts there are. */
export const MAX_RETRY_DELAY_MS = 86_400_000;

/** Jitter adds up to this fraction of the delay. */
export const JITTER_FRACTION = 0.2;

/**
 * Delay before the attempt that follows the run's `failure`-th failure (1-based, counted since its
 * last replay: failuresBefore in store/runs.ts): `backoffMs × multiplier^(failure − 1)`, capped at {@link MAX_RETRY_DELAY_MS}, plus a random
 * 0–20 %. The configured delay is a floor, never shortened: an operator who asked for 1 s between
 * attempts gets at least 1 s; the jitter only spreads the retries of many runs that failed together
 * (an outage of a shared target) so they do not return in one burst.
 * @param random a source of [0, 1) numbers; default Math.random (injected by tests).
 */
export function retryDelayMs(
  failure: number,
  policy: RetryPolicy,
  random: () => number = Math.random,
): number {
  const exponent = Math.max(0, failure - 1);
  const base = Math.min(
    MAX_RETRY_DELAY_MS,
    policy.backoffMs * Math.pow(Math.max(1, policy.backoffMultiplier), exponent),
  );
  const jittered = base * (1 + JITTER_FRACTION * Math.min(Math.max(random(), 0), 1));
  return Math.round(Math.min(MAX_RETRY_DELAY_MS, jittered));
}
