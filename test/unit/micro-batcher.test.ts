import assert from 'node:assert/strict';
import { test } from 'node:test';
import { oneByOne } from '../../src/execution/batching.js';
import { BatchItemError, MicroBatcher } from '../../src/execution/micro-batcher.js';

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
