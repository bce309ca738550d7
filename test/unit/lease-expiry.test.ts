import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeaseExpiryWatch, type LeaseVerdict } from '../../src/coordination/lease-expiry.js';
import {
  randomHolder,
  simulateLease as simulate,
  type LeaseObserver as Observer,
  type LeaseScenario as Scenario,
} from '../support/lease-simulation.js';

/** A round trip split evenly around etcd's answer. */
function roundTrip(ms: number): Pick<Scenario, 'requestMs' | 'responseMs'> {
  return { requestMs: () => ms / 2, responseMs: () => ms / 2 };
}

/** A holder that renews every third of its TTL, then late (with under a second left), then stops. */
function scenario(seed: number): Scenario {
  // Late renewals are the dangerous ones: with 0–1 s left, etcd already answers 0.
  const { random, grantedSeconds, renewals } = randomHolder(seed, { min: 1, span: 999 });
  const stallEvery = 2 + Math.floor(random() * 10);
  const stall = random() * 1800;
  return {
    grantedSeconds,
    renewals,
    ...roundTrip(1 + random() * 8),
    stallMs: (look) => (look % stallEvery === 0 ? stall : 0),
  };
}

test('a lease is declared expired only once it has expired at etcd, under renewals late by up to a second and stalls', () => {
  for (let seed = 1; seed <= 3000; seed++) {
    const result = simulate(new LeaseExpiryWatch('1'), scenario(seed));
    if (result.verdictAt !== null) {
      assert.ok(result.lateBy >= 0, `seed ${seed}: declared expired ${-result.lateBy} ms before the expiry`);
    }
  }
});

test('a lease nobody renews is declared expired within 100 ms of its expiry, before etcd removes it', () => {
  for (const granted of [2, 3, 5]) {
    for (const rttMs of [1, 5]) {
      const result = simulate(new LeaseExpiryWatch('1'), {
        grantedSeconds: granted,
        renewals: [700, 1400],
        ...roundTrip(rttMs),
      });
      assert.ok(result.verdictAt !== null, `TTL ${granted} s: left to etcd`);
      assert.ok(
        result.lateBy >= 0 && result.lateBy <= 100,
        `TTL ${granted} s: ${result.lateBy} ms after the expiry`,
      );
    }
  }
});

test('a lease renewed with less than a second left is not declared expired', () => {
  const watch = new LeaseExpiryWatch('1');
  // Granted 2 s at 0; answers of 0 from 1,000 ms on; renewed at 1,900 (2 s again: answers 1).
  assert.equal(watch.observe(1, 2, 0, 2), 'live');
  assert.equal(watch.observe(0, 2, 1000, 1002), 'live');
  assert.equal(watch.observe(0, 2, 1850, 1852), 'live');
  assert.equal(watch.observe(1, 2, 1950, 1952), 'live', 'the renewal shows');
  assert.equal(watch.observe(0, 2, 2950, 2952), 'live', 'a new run of zeros starts its own second');
  assert.equal(watch.observe(0, 2, 3500, 3502), 'live');
  assert.equal(watch.observe(0, 2, 3975, 3977), 'expired');
});

test('answers further apart than 900 ms start the second over, since a renewal could lie between them', () => {
  const watch = new LeaseExpiryWatch('1');
  assert.equal(watch.observe(0, 2, 0, 2), 'live');
  assert.equal(watch.observe(0, 2, 1100, 1102), 'live', 'a gap of 1,100 ms: could hide a renewal at 500');
  assert.equal(watch.observe(0, 2, 1900, 1902), 'live');
  assert.equal(watch.observe(0, 2, 2125, 2127), 'expired');
});

test('a lease granted for less than 2 s is left to etcd', () => {
  const watch = new LeaseExpiryWatch('1');
  for (let t = 0; t < 5000; t += 50) assert.equal(watch.observe(0, 1, t, t + 1), 'live');
  assert.equal(watch.observe(-1, 0, 5000, 5001), 'gone');
});

test('the simulation catches a rule that revokes on the first answer of 0', () => {
  const eager: Observer = {
    checkInMs: 0,
    observe(ttl) {
      this.checkInMs = 50;
      return ttl < 0 ? 'gone' : ttl === 0 ? 'expired' : 'live';
    },
  };
  const early = [1, 2, 3, 4, 5, 6, 7, 8].map((seed) => simulate(eager, scenario(seed)).lateBy);
  assert.ok(
    early.some((lateBy) => lateBy < 0),
    `the eager rule was never caught: ${early.join(', ')}`,
  );
});

test('the simulation catches a rule that ignores a gap between answers', () => {
  class NoGapCheck extends LeaseExpiryWatch {
    override observe(ttl: number, granted: number, _askedAt: number, receivedAt: number): LeaseVerdict {
      return super.observe(ttl, granted, receivedAt + 1e6, receivedAt); // no gap ever looks long
    }
  }
  let caught = 0;
  for (let seed = 1; seed <= 3000; seed++) {
    const result = simulate(new NoGapCheck('1'), scenario(seed));
    if (result.verdictAt !== null && result.lateBy < 0) caught++;
  }
  assert.ok(caught > 0, 'no scenario caught it');
});

test('zeros from another raft term start the second over: a stale etcd leader cannot prove an expiry', () => {
  const watch = new LeaseExpiryWatch('1');
  assert.equal(watch.observe(0, 3, 0, 2, '7'), 'live');
  assert.equal(watch.observe(0, 3, 600, 602, '7'), 'live');
  assert.equal(watch.observe(0, 3, 1030, 1032, '8'), 'live', 'a new term: its own second');
  assert.equal(watch.term, '8');
  assert.equal(watch.observe(0, 3, 1600, 1602, '8'), 'live');
  assert.equal(watch.observe(0, 3, 2060, 2062, '8'), 'expired');
});
