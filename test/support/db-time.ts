import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Queryable } from '../../src/store/db.js';

/** The database's clock now (clock_timestamp()), epoch ms: what claims and START compare against. */
export async function dbNow(db: Queryable): Promise<number> {
  const { rows } = await db.query<{ t: Date }>('SELECT clock_timestamp() AS t');
  return rows[0]!.t.getTime();
}

/** Resolves once the database's clock has reached `at`. */
export async function untilDbTime(db: Queryable, at: Date | number): Promise<void> {
  const target = typeof at === 'number' ? at : at.getTime();
  for (;;) {
    const left = target - (await dbNow(db));
    if (left <= 0) return;
    await sleep(Math.min(left + 2, 200));
  }
}

/** Resolves to `promise`'s value and how long it took; fails the test after `ms`. */
export async function within<T>(
  promise: Promise<T>,
  ms: number,
  what: string,
): Promise<{ value: T; ms: number }> {
  const t0 = performance.now();
  const settled = await Promise.race([
    promise.then((value) => ({ value, ms: performance.now() - t0 })),
    sleep(ms).then(() => 'stalled' as const),
  ]);
  if (settled === 'stalled') assert.fail(`${what} did not end within ${ms} ms`);
  return settled;
}
