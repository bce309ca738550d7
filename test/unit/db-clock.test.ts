import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DbClock } from '../../src/execution/db-clock.js';
import type { Queryable } from '../../src/store/db.js';

// The database is a fake here (pure logic): a clock `skewMs` ahead of this host's.
const databaseAhead = (skewMs: number): Queryable =>
  ({
    query: async () => ({ rows: [{ ms: Date.now() + skewMs }] }),
  }) as unknown as Queryable;

test('the estimate follows the database clock, and a step of the wall clock does not move it', async (t) => {
  const clock = new DbClock();
  await clock.sync(databaseAhead(5_000));
  assert.ok(Math.abs(clock.now() - (Date.now() + 5_000)) < 50, 'synced to the database clock');
  assert.ok(Math.abs(clock.offset - 5_000) < 50, `offset ${clock.offset}`);
  const before = clock.now();
  // This host's wall clock is stepped 700 ms ahead (an NTP correction) between two samples.
  const realNow = Date.now;
  t.mock.method(Date, 'now', () => realNow() + 700);
  const after = clock.now();
  assert.ok(
    after - before >= 0 && after - before < 50,
    `the estimate moved ${after - before} ms with the wall clock`,
  );
  assert.ok(Math.abs(clock.offset - 4_300) < 50, 'the offset to the stepped wall clock is reported');
});

test('before its first sample the estimate is the wall clock', () => {
  assert.ok(Math.abs(new DbClock().now() - Date.now()) < 50);
});
