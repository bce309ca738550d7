import type { LeaseVerdict } from '../../src/coordination/lease-expiry.js';

// etcd as a standby's lease checks see it: a lease's time left, answered in whole seconds
// truncated (etcd's LeaseTimeToLive computes int64(Remaining().Seconds())), −1 once etcd's own
// revocation loop (every 500 ms) has removed it; a renewal of an expired lease is refused.

export interface LeaseObserver {
  checkInMs: number;
  observe(ttl: number, granted: number, askedAt: number, receivedAt: number): LeaseVerdict;
}

export interface LeaseScenario {
  grantedSeconds: number;
  /** When the holder's renewals reach etcd (ms after the grant); none after the last. */
  renewals: number[];
  /** From asking until etcd computes the answer, per look. */
  requestMs: (look: number) => number;
  /** From etcd computing the answer until the standby reads its clock after the await. */
  responseMs: (look: number, askedAt: number) => number;
  /** Extra delay before a look (the standby's event loop busy), per look. */
  stallMs?: (look: number) => number;
}

export interface LeaseOutcome {
  /** When the standby declared the lease expired; null when it saw it gone first. */
  readonly verdictAt: number | null;
  /** The lease's real expiry at etcd at that moment (renewals up to then applied). */
  readonly expiryAtVerdict: number;
  /** verdictAt − expiryAtVerdict: negative when a live lease was declared expired. */
  readonly lateBy: number;
  /** When etcd computed the answer that tipped the verdict. */
  readonly lastComputedAt: number;
}

/** Runs one standby's checks against one lease until a verdict. */
export function simulateLease(watch: LeaseObserver, s: LeaseScenario): LeaseOutcome {
  let expiresAt = s.grantedSeconds * 1000; // granted at 0
  const renewals = [...s.renewals];
  const expiryAt = (t: number): number => {
    while (renewals.length && renewals[0]! <= t) {
      const at = renewals.shift()!;
      if (at < expiresAt) expiresAt = at + s.grantedSeconds * 1000;
    }
    return expiresAt;
  };
  let now = 0;
  for (let look = 0; look < 10_000; look++) {
    now += watch.checkInMs + (s.stallMs?.(look) ?? 0);
    const askedAt = now;
    const computedAt = askedAt + s.requestMs(look);
    const expiry = expiryAt(computedAt);
    const revokedAt = expiry + 500 * ((expiry / 1000) % 1); // etcd's loop, somewhere in 0–500 ms
    const ttl = computedAt >= revokedAt ? -1 : Math.trunc((expiry - computedAt) / 1000);
    now = computedAt + s.responseMs(look, askedAt);
    const verdict = watch.observe(ttl, s.grantedSeconds, askedAt, now);
    if (verdict === 'expired') {
      const expiryAtVerdict = expiryAt(now);
      return { verdictAt: now, expiryAtVerdict, lateBy: now - expiryAtVerdict, lastComputedAt: computedAt };
    }
    if (verdict === 'gone')
      return { verdictAt: null, expiryAtVerdict: expiry, lateBy: now - expiry, lastComputedAt: computedAt };
  }
  throw new Error('the simulation did not end');
}

/**
 * A seeded holder: granted 2–4 s, up to 7 renewals, half of them late (with `lateLeft.min` to
 * `lateLeft.min + lateLeft.span` ms left: under a second, when etcd already answers 0). Returns
 * the generator too, for the scenario's own draws after these.
 */
export function randomHolder(
  seed: number,
  lateLeft: { min: number; span: number },
): { random: () => number; grantedSeconds: number; renewals: number[] } {
  let state = seed;
  const random = () => (state = (state * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
  const grantedSeconds = 2 + Math.floor(random() * 3);
  const renewals: number[] = [];
  let at = 0;
  for (let i = 0, n = Math.floor(random() * 8); i < n; i++) {
    const late = random() < 0.5;
    at += late
      ? grantedSeconds * 1000 - lateLeft.min - random() * lateLeft.span
      : random() * grantedSeconds * 1000;
    renewals.push(Math.round(at));
  }
  return { random, grantedSeconds, renewals };
}
