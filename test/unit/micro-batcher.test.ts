import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { MicroBatcher } from '../../src/execution/micro-batcher.js';

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
  await sleep(5);
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
  await sleep(5);
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
  await sleep(5);
  const later = [2, 3, 4].map((i) => batcher.add(i));
  await sleep(5);
  await sleep(5);
  assert.deepEqual(
    batches.map((b) => b.items),
    [[1]],
    'nothing else starts while the first batch runs',
  );
  batches[0]!.release();
  assert.equal(await first, 10);
  await sleep(5);
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
