import assert from 'node:assert/strict';
import { test } from 'node:test';
import { DbClock } from '../../src/execution/db-clock.js';
import type { Queryable } from '../../src/store/db.js';

// The database is a fake here (pure logic): a clock `skewMs` ahead of this host's real one. The
// host's two clocks are fakes too: a wall clock that can step and a monotonic one that can stop.

const realNow = Date.now;

function host() {
  const state = { wallStepMs: 0, monotonicStoppedMs: 0 };
  const monotonic = () => performance.now() - state.monotonicStoppedMs;
  return { state, monotonic };
}

const databaseAhead = (skewMs: number): Queryable & { samples: number } => {
  const db = {
    samples: 0,
    query: async () => {
      db.samples += 1;
      return { rows: [{ ms: realNow() + skewMs }] };
    },
  };
  return db as unknown as Queryable & { samples: number };
};

test('a step of the wall clock neither fires runs early nor leaves a claim more time; the next sync re-samples', async (t) => {
  const { state, monotonic } = host();
  t.mock.method(Date, 'now', () => realNow() + state.wallStepMs);
  const clock = new DbClock(monotonic);
  const db = databaseAhead(5_000);
  await clock.sync(db);
  assert.ok(Math.abs(clock.now() - (realNow() + 5_000)) < 20, 'synced to the database clock');
  assert.ok(Math.abs(clock.offset - 5_000) < 20, `offset ${clock.offset}`);
  assert.equal(clock.disagreeing, false);

  // An NTP correction steps the wall clock 700 ms ahead between two samples.
  state.wallStepMs = 700;
  const truth = realNow() + 5_000;
  assert.ok(Math.abs(clock.now() - truth) < 20, `due times: the estimate moved ${clock.now() - truth} ms`);
  const deadline = new Date(truth + 10_000);
  assert.ok(
    Math.abs(clock.msLeftUntil(deadline) - 9_300) < 20,
    `a claim's time left is judged by the later estimate: ${clock.msLeftUntil(deadline)}`,
  );
  assert.equal(clock.disagreeing, true);
  const samples = db.samples;
  await clock.sync(db, 30_000);
  assert.ok(db.samples > samples, 'the clocks disagree: re-sampled although the sample is fresh');
  assert.equal(clock.disagreeing, false);
  assert.ok(Math.abs(clock.now() - (realNow() + 5_000)) < 20);
});

test("a host suspended (its monotonic clock stopped) does not believe its claims have the suspension's time left", async () => {
  const { state, monotonic } = host();
  const clock = new DbClock(monotonic);
  const db = databaseAhead(0);
  await clock.sync(db);
  // The host slept 8 s: the wall clock and the database's went on, the monotonic clock did not
  // (here: the monotonic clock is set 8 s back, the others stay).
  state.monotonicStoppedMs = 8_000;
  const deadline = new Date(realNow() + 10_000);
  assert.ok(
    Math.abs(clock.msLeftUntil(deadline) - 10_000) < 20,
    `time left on the claim: ${clock.msLeftUntil(deadline)} ms, not the monotonic clock's 18 s`,
  );
  assert.ok(clock.now() <= realNow() + 20, 'due times never early');
  assert.equal(clock.disagreeing, true);
  await clock.sync(db, 30_000);
  assert.ok(Math.abs(clock.now() - realNow()) < 20, 're-sampled at once');
});

test('before its first sample the estimate is the wall clock', () => {
  const clock = new DbClock();
  assert.ok(Math.abs(clock.now() - Date.now()) < 20);
  assert.equal(clock.disagreeing, false);
});

test('syncs asked for while one samples share it (a herd of early starts asks at once)', async () => {
  const db = databaseAhead(1_000);
  const clock = new DbClock();
  await Promise.all([clock.sync(db), clock.sync(db), clock.sync(db)]);
  assert.equal(db.samples, 3, 'one sampling of three round trips');
  await clock.sync(db);
  assert.equal(db.samples, 6, 'a sync after it samples again');
});
