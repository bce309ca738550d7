import assert from 'node:assert/strict';
import { test } from 'node:test';
import { JITTER_FRACTION, MAX_RETRY_DELAY_MS, retryDelayMs } from '../../src/execution/backoff.js';

const policy = { backoffMs: 1000, backoffMultiplier: 2 };

test('the delay grows exponentially from backoffMs, without jitter at random() = 0', () => {
  assert.deepEqual(
    [1, 2, 3, 4].map((attempt) => retryDelayMs(attempt, policy, () => 0)),
    [1000, 2000, 4000, 8000],
  );
});

test('jitter only lengthens the delay, by at most JITTER_FRACTION', () => {
  assert.equal(
    retryDelayMs(1, policy, () => 0.999999),
    Math.round(1000 * (1 + JITTER_FRACTION * 0.999999)),
  );
  for (let i = 0; i < 1000; i++) {
    const delay = retryDelayMs(3, policy);
    assert.ok(delay >= 4000 && delay <= 4000 * (1 + JITTER_FRACTION), `delay ${delay}`);
  }
});

test('jitter spreads the retries of runs that failed together', () => {
  const delays = new Set(Array.from({ length: 50 }, () => retryDelayMs(1, policy)));
  assert.ok(delays.size > 10, `only ${delays.size} distinct delays`);
});

test('a multiplier of 1 gives a constant delay, and 0 ms backoff retries at once', () => {
  assert.equal(
    retryDelayMs(7, { backoffMs: 500, backoffMultiplier: 1 }, () => 0),
    500,
  );
  assert.equal(
    retryDelayMs(3, { backoffMs: 0, backoffMultiplier: 10 }, () => 0.5),
    0,
  );
});

test('huge exponents are capped at a day instead of overflowing', () => {
  const delay = retryDelayMs(100, { backoffMs: 86_400_000, backoffMultiplier: 10 }, () => 0.5);
  assert.equal(delay, MAX_RETRY_DELAY_MS);
  assert.ok(Number.isFinite(retryDelayMs(1000, { backoffMs: 1, backoffMultiplier: 10 })));
});

test('out-of-range random values are clamped', () => {
  assert.equal(
    retryDelayMs(1, policy, () => -5),
    1000,
  );
  assert.equal(
    retryDelayMs(1, policy, () => 5),
    1000 * (1 + JITTER_FRACTION),
  );
});
