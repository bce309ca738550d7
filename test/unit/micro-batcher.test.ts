import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import {
  CLAIM_LEFT_AFTER_HOLD_MS,
  completionMayWait,
  oneByOne,
  settleReadTimeoutMs,
} from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import { BatchItemError, MicroBatcher } from '../../src/execution/micro-batcher.js';
import type { AttemptReport } from '../../src/store/attempts.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';

/**
 * Lets the batcher's setImmediate callbacks run: a few turns of the event loop. (A fixed 5 ms
 * sleep raced them on a loaded machine: the timer can be due before the check phase comes.)
 */
async function turns(n = 3): Promise<void> {
  for (let i = 0; i < n; i++) await new Promise((resolve) => setImmediate(resolve));
}

/** A batch function whose batches finish only when the test releases them. */
function gatedBatches() {
  const batches: { items: number[]; release: () => void }[] = [];
  const run = (items: number[]) =>
    new Promise<number[]>((resolve) => {
      batches.push({ items, release: () => resolve(items.map((i) => i * 10)) });
    });
  return { batches, run };
}

test('calls made in one turn go in one batch, and each gets its own result', async () => {
  const { batches, run } = gatedBatches();
  const batcher = new MicroBatcher(run, 100);
  const results = Promise.all([1, 2, 3].map((i) => batcher.add(i)));
  await turns();
  assert.deepEqual(
    batches.map((b) => b.items),
    [[1, 2, 3]],
  );
  batches[0]!.release();
  assert.deepEqual(await results, [10, 20, 30]);
});

test('a turn with more than maxBatch calls is split', async () => {
  const { batches, run } = gatedBatches();
  const batcher = new MicroBatcher(run, 2);
  const results = Promise.all([1, 2, 3, 4, 5].map((i) => batcher.add(i)));
  await turns();
  assert.deepEqual(
    batches.map((b) => b.items),
    [[1, 2], [3, 4], [5]],
  );
  for (const b of batches) b.release();
  assert.deepEqual(await results, [10, 20, 30, 40, 50]);
});

test('with maxInFlight reached, later calls wait and then go together in one batch', async () => {
  const { batches, run } = gatedBatches();
  const batcher = new MicroBatcher(run, 100, 1);
  const first = batcher.add(1);
  await turns();
  const later = [2, 3, 4].map((i) => batcher.add(i));
  await turns();
  await turns();
  assert.deepEqual(
    batches.map((b) => b.items),
    [[1]],
    'nothing else starts while the first batch runs',
  );
  batches[0]!.release();
  assert.equal(await first, 10);
  await turns();
  assert.deepEqual(
    batches.map((b) => b.items),
    [[1], [2, 3, 4]],
  );
  batches[1]!.release();
  assert.deepEqual(await Promise.all(later), [20, 30, 40]);
});

test('a failed batch rejects its calls only, and the next batch still runs', async () => {
  let calls = 0;
  const batcher = new MicroBatcher<number, number>(
    async (items) => {
      calls += 1;
      if (calls === 1) throw new Error('database went away');
      return items;
    },
    10,
    1,
  );
  const failed = [batcher.add(1), batcher.add(2)];
  await assert.rejects(failed[0]!, /database went away/);
  await assert.rejects(failed[1]!, /database went away/);
  assert.equal(await batcher.add(3), 3);
});

test('an item the batch function fails on its own rejects only that call', async () => {
  const batcher = new MicroBatcher(
    async (items: number[]) => items.map((i) => (i === 2 ? new BatchItemError(new Error('two')) : i * 10)),
    100,
  );
  const results = await Promise.allSettled([1, 2, 3].map((i) => batcher.add(i)));
  assert.deepEqual(
    results.map((r) => (r.status === 'fulfilled' ? r.value : (r.reason as Error).message)),
    [10, 'two', 30],
  );
});

test('oneByOne gives each item its own answer, and stops trying when the first ones all fail', async () => {
  const tried: number[] = [];
  const single = async (i: number) => {
    tried.push(i);
    if (i === 2) throw new Error(`bad ${i}`);
    return i * 10;
  };
  const mixed = await oneByOne([1, 2, 3], single);
  assert.deepEqual(
    mixed.map((r) => (r instanceof BatchItemError ? r.error.message : r)),
    [10, 'bad 2', 30],
  );
  tried.length = 0;
  const down = await oneByOne([1, 2, 3, 4], async (i) => {
    tried.push(i);
    throw new Error('connection refused');
  });
  assert.deepEqual(tried, [1, 2], 'an outage is not tried item by item');
  assert.ok(down.every((r) => r instanceof BatchItemError && r.error.message === 'connection refused'));
});

test('oneByOne: items the database refuses on their own, however many lead the batch, do not fail the rest', async () => {
  const refused = (i: number) => Object.assign(new Error(`trigger refused ${i}`), { code: 'P0001' });
  const results = await oneByOne([1, 2, 3, 4], async (i) => {
    if (i <= 2) throw refused(i);
    return i * 10;
  });
  assert.deepEqual(
    results.map((r) => (r instanceof BatchItemError ? r.error.message : r)),
    ['trigger refused 1', 'trigger refused 2', 30, 40],
  );
});

/** A wait policy whose busy() the test sets. */
function waitPolicy(maxWaitMs = 10_000, maxWaiting = 100) {
  const state = { busy: true };
  return { state, policy: { busy: () => state.busy, maxWaitMs, maxWaiting } };
}

test('items that may wait are held while the policy is busy, and go together on release once it is not', async () => {
  const { batches, run } = gatedBatches();
  const { state, policy } = waitPolicy();
  const batcher = new MicroBatcher(run, 100, 2, policy);
  const results = Promise.all([1, 2, 3].map((i) => batcher.add(i, true)));
  await turns();
  assert.equal(batches.length, 0, 'held while busy');
  assert.equal(batcher.held, 3);
  batcher.release(); // still busy: a release changes nothing
  await turns();
  assert.equal(batches.length, 0);
  state.busy = false;
  batcher.release();
  await turns();
  assert.deepEqual(
    batches.map((b) => b.items),
    [[1, 2, 3]],
  );
  assert.equal(batcher.held, 0, 'once they go they wait for the database as any write');
  batches[0]!.release();
  assert.deepEqual(await results, [10, 20, 30]);
  assert.equal(batcher.held, 0);
});

test('an item that may not wait takes the held ones with it; without a policy nothing waits', async () => {
  const { batches, run } = gatedBatches();
  const { policy } = waitPolicy();
  const batcher = new MicroBatcher(run, 100, 2, policy);
  void batcher.add(1, true);
  void batcher.add(2, true);
  await turns();
  assert.equal(batches.length, 0);
  void batcher.add(3);
  await turns();
  assert.deepEqual(
    batches.map((b) => b.items),
    [[1, 2, 3]],
  );
  // While that batch runs nothing is held (a slow database must slow the callers).
  void batcher.add(4, true);
  await turns();
  assert.deepEqual(batches[1]?.items, [4]);
  // Once no batch runs, the urgent item having been counted out, items are held again.
  batches[0]!.release();
  batches[1]!.release();
  await turns();
  void batcher.add(5, true);
  await turns();
  assert.equal(batches.length, 2);
  assert.equal(batcher.held, 1);

  const plain = gatedBatches();
  const unpolicied = new MicroBatcher(plain.run, 100, 2);
  void unpolicied.add(1, true);
  await turns();
  assert.deepEqual(
    plain.batches.map((b) => b.items),
    [[1]],
  );
  assert.equal(unpolicied.held, 0);
});

test('held items go once the oldest has waited maxWaitMs, or once maxWaiting are held, however busy', async () => {
  const timed = { batches: [] as number[][] };
  const { policy } = waitPolicy(30);
  const batcher = new MicroBatcher(
    async (items: number[]) => {
      timed.batches.push(items);
      return items;
    },
    100,
    2,
    policy,
  );
  const since = performance.now();
  void batcher.add(1, true);
  await sleep(10);
  void batcher.add(2, true);
  await turns();
  assert.equal(timed.batches.length, 0);
  while (timed.batches.length === 0) await sleep(2);
  assert.ok(performance.now() - since >= 30, 'not before the oldest waited maxWaitMs');
  assert.deepEqual(timed.batches[0], [1], 'only the item that waited its time');
  assert.equal(batcher.held, 1, 'item 2 still held');
  while (timed.batches.length === 1) await sleep(2);
  assert.ok(performance.now() - since >= 40);
  assert.deepEqual(timed.batches[1], [2]);

  const counted = gatedBatches();
  const full = new MicroBatcher(counted.run, 100, 2, waitPolicy(10_000, 3).policy);
  void full.add(1, true);
  void full.add(2, true);
  await turns();
  assert.equal(counted.batches.length, 0);
  void full.add(3, true);
  await turns();
  assert.deepEqual(
    counted.batches.map((b) => b.items),
    [[1, 2, 3]],
  );
});

test('items that went, or were added after a hold ended, are not counted as held', async () => {
  const { batches, run } = gatedBatches();
  const { state, policy } = waitPolicy();
  const batcher = new MicroBatcher(run, 100, 1, policy);
  void batcher.add(1, true);
  await turns();
  state.busy = false;
  batcher.release();
  await turns();
  assert.equal(batches.length, 1);
  void batcher.add(2, true); // waits for room (maxInFlight 1), not for the policy
  await turns();
  assert.equal(batcher.held, 0, 'item 1 in flight, item 2 waiting for room');
  batches[0]!.release();
  await turns();
  assert.equal(batcher.held, 0);
  assert.deepEqual(batches[1]!.items, [2]);
});

test('completionMayWait: only an allow run with a short excerpt and 4 s of its claim left after the wait', () => {
  const clock = new DbClock();
  const report = (excerpt: string | null): AttemptReport => ({
    outcome: 'succeeded',
    statusCode: 200,
    durationMs: 3,
    error: null,
    responseExcerpt: excerpt,
  });
  const run = (concurrency: ClaimedRun['concurrency'], claimLeftMs = 10_000): ClaimedRun => ({
    ...fakeClaimedRun('r1'),
    concurrency,
    claimExpiresAt: new Date(Date.now() + claimLeftMs),
  });
  const hold = 2000;
  const mayWait = (r: ClaimedRun, a: AttemptReport, holdMs = hold) => completionMayWait(r, a, clock, holdMs);
  assert.equal(mayWait(run('allow'), report('ok')), true);
  assert.equal(mayWait(run('allow'), report(null)), true);
  assert.equal(mayWait(run('allow'), report('ok'), 0), false, 'HELIOS_COMPLETION_HOLD_MS=0: never');
  assert.equal(mayWait(run('forbid'), report('ok')), false, 'its next run waits for it');
  assert.equal(mayWait(run('replace'), report('ok')), false);
  assert.equal(mayWait(run('allow'), report('x'.repeat(1025))), false, 'kept in memory');
  assert.equal(mayWait(run('allow', hold + CLAIM_LEFT_AFTER_HOLD_MS + 100), report('ok')), true);
  const tight = run('allow', hold + CLAIM_LEFT_AFTER_HOLD_MS - 100);
  assert.equal(mayWait(tight, report('ok')), false, 'too little of the claim left');
});

test("settleReadTimeoutMs: half of what is left of the batch's earliest claim, at least 250 ms, at most the pool's 35 s", () => {
  const clock = { latestNow: () => 1_000_000 };
  const expiring = (leftMs: number) => ({ run: { claimExpiresAt: new Date(1_000_000 + leftMs) } });
  assert.equal(settleReadTimeoutMs([expiring(4000)], clock), 2000);
  assert.equal(settleReadTimeoutMs([expiring(1000), expiring(6000)], clock), 500, 'the earliest claim');
  assert.equal(settleReadTimeoutMs([{ run: {} }, expiring(6000)], clock), 3000, 'of those with a deadline');
  assert.equal(settleReadTimeoutMs([expiring(300)], clock), 250, 'at least 250 ms');
  assert.equal(settleReadTimeoutMs([expiring(-500)], clock), 250, 'expired: 250 ms');
  assert.equal(settleReadTimeoutMs([expiring(3_600_000)], clock), 35_000, "the pool's read timeout at most");
  assert.equal(settleReadTimeoutMs([{ run: {} }], clock), undefined, "no deadline: the pool's");
  assert.equal(settleReadTimeoutMs([expiring(4000)], undefined), undefined, "no clock: the pool's");
});
