import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeaseExpiryWatch, type LeaseVerdict } from '../../src/coordination/lease-expiry.js';
import {
  randomHolder,
  simulateLease as simulate,
  type LeaseScenario as Scenario,
} from '../support/lease-simulation.js';

// Found by review of the first version of LeaseExpiryWatch (commit 005cf27), fixed since. The
// expiry is bounded by the first zero's *receipt* (sound: etcd computed it earlier); the first
// version then also checked the latest answer's *receipt* against that bound. etcd computed the latest answer somewhere in [askedAt, receivedAt];
// if it was computed before the expiry and only *reached* the standby late (a slow response path,
// or the standby's event loop busy between the answer arriving and performance.now()), a renewal
// between etcd computing it and the standby's revoke is invisible: the standby revokes a lease
// that etcd just renewed.

/** The rule as first written (commit 005cf27): the latest zero judged by when it was received. */
class ReceivedAtRule extends LeaseExpiryWatch {
  override observe(ttl: number, granted: number, _askedAt: number, receivedAt: number): LeaseVerdict {
    return super.observe(ttl, granted, receivedAt, receivedAt);
  }
}

/**
 * Granted 3 s at 0, renewed at 2,400 ms (0.6 s left); the first look asked at ≥ 2,300 ms is
 * answered by etcd at once (TTL 0) but reaches the standby 780 ms later; other looks take 2 ms.
 */
function lateZeroScenario(): Scenario {
  let slowAsked = -1;
  return {
    grantedSeconds: 3,
    renewals: [2400],
    requestMs: () => 1,
    responseMs: (_look, askedAt) => {
      if (slowAsked < 0 && askedAt >= 2300) slowAsked = askedAt;
      return askedAt === slowAsked ? 780 : 1;
    },
  };
}

test('the last zero is computed before a late renewal but reaches the standby 780 ms later: not declared expired', () => {
  // Lease granted 3 s at 0 (expires 3,000). The holder's Helios deadline is 0 + 3,000 − 500 =
  // 2,500, so its keep-alive at 2,400 (0.6 s left: it had been retrying) is legitimate and
  // succeeds: etcd now expires it at 5,400 and the holder leads until 2,399 + 2,500 = 4,899.
  // The standby looks every ~50 ms with 2 ms round trips; the look asked at ≥ 2,300 is answered
  // by etcd at once (TTL 0, 0.7 s left) but its answer reaches the standby 780 ms later.
  const outcome = simulate(new LeaseExpiryWatch('1'), lateZeroScenario());
  assert.ok(outcome.verdictAt !== null, 'no verdict');
  assert.ok(
    outcome.verdictAt >= outcome.expiryAtVerdict,
    `declared expired at ${outcome.verdictAt} ms on an answer etcd computed at ${outcome.lastComputedAt} ms; ` +
      `the lease was renewed at 2400 ms and expires at ${outcome.expiryAtVerdict} ms ` +
      `(the holder leads until 4899 ms: two leaders)`,
  );
});

test('the same interleaving catches the rule that judged the latest answer by when it was received', () => {
  const outcome = simulate(new ReceivedAtRule('1'), lateZeroScenario());
  assert.ok(outcome.verdictAt !== null);
  assert.ok(outcome.verdictAt < outcome.expiryAtVerdict, 'the received-at rule was not caught');
});

/** Random holders (renewing late, as in lease-expiry.test.ts) and answers that are sometimes slow to arrive. */
function scenario(seed: number): Scenario {
  // Helios renews while its deadline (sentAt + TTL − 500 ms) has not passed: ≥ 0.5 s left.
  const { random, grantedSeconds, renewals } = randomHolder(seed, { min: 500, span: 499 });
  const slowEvery = 2 + Math.floor(random() * 20);
  const slowMs = random() * 990; // under the 1 s withTimeout around LeaseTimeToLive
  return {
    grantedSeconds,
    renewals,
    requestMs: () => 1,
    responseMs: (look) => (look % slowEvery === 0 ? slowMs : 1),
  };
}

test('simulation: answers that reach the standby late (any delay under its 1 s timeout) never make it revoke a live lease', () => {
  const early: string[] = [];
  for (let seed = 1; seed <= 3000; seed++) {
    const outcome = simulate(new LeaseExpiryWatch('1'), scenario(seed));
    if (outcome.verdictAt !== null && outcome.verdictAt < outcome.expiryAtVerdict)
      early.push(`seed ${seed}: ${Math.round(outcome.expiryAtVerdict - outcome.verdictAt)} ms early`);
  }
  assert.deepEqual(early.slice(0, 5), [], `${early.length} of 3000 scenarios revoked a live lease`);
});

test('simulation: the received-at rule is caught under the same delays; the asked-at rule stays prompt without them', () => {
  let caught = 0;
  for (let seed = 1; seed <= 3000; seed++) {
    const outcome = simulate(new ReceivedAtRule('1'), scenario(seed));
    if (outcome.verdictAt !== null && outcome.verdictAt < outcome.expiryAtVerdict) caught++;
  }
  assert.ok(caught > 0, 'no scenario caught the received-at rule');
  for (const granted of [2, 3, 5]) {
    const outcome = simulate(new LeaseExpiryWatch('1'), {
      grantedSeconds: granted,
      renewals: [700, 1400],
      requestMs: () => 1,
      responseMs: () => 1,
    });
    assert.ok(outcome.verdictAt !== null);
    const lateBy = outcome.verdictAt - outcome.expiryAtVerdict;
    assert.ok(lateBy >= 0 && lateBy <= 100, `TTL ${granted}: ${lateBy} ms after expiry`);
  }
});

test('holds: an answer of -1 (expired over a second ago, not yet revoked) is "gone", never "expired"', () => {
  // etcd answers int64(Remaining().Seconds()): −1 also for a lease that expired ≥ 1 s ago but that
  // its loop has not revoked yet. The watch calls that "gone" and leaves the key to etcd: no unsafe
  // revoke, only the old latency (election.ts then re-reads the key every checkInMs until etcd deletes it).
  const watch = new LeaseExpiryWatch('1');
  assert.equal(watch.observe(0, 3, 0, 2), 'live');
  assert.equal(watch.observe(-1, 3, 1200, 1202), 'gone');
});
