import assert from 'node:assert/strict';
import { test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { pino } from 'pino';
import { LeaderStallWatch } from '../../src/coordination/leader-stall.js';

// The leader's stall watch (README, "A leader that cannot reach PostgreSQL hands over"), with a
// probe that answers as each test says. The real probe, partitions and silent connections:
// leader-database-partition and leader-stall-review-*.

const STALL_MS = 200;

type Verdict = 'answering' | 'sessions-lost';

function watch(probe: () => Promise<Verdict>) {
  const controller = new AbortController();
  const unreachable: Error[] = [];
  let probes = 0;
  const w = new LeaderStallWatch({
    signal: controller.signal,
    stallMs: STALL_MS,
    probe: async () => {
      probes += 1;
      return { verdict: await probe() };
    },
    stepDown: (err) => unreachable.push(err),
    logger: pino({ level: 'silent' }),
  });
  return { w, controller, unreachable, probes: () => probes };
}

test('a leader that commits passes is never probed', async () => {
  const { w, controller, unreachable, probes } = watch(() => Promise.reject(new Error('cut off')));
  for (let i = 0; i < 12; i++) {
    await sleep(STALL_MS / 4);
    w.progressed();
  }
  controller.abort();
  assert.equal(probes(), 0);
  assert.deepEqual(unreachable, []);
});

test('no pass committed within the limit and the probe fails: unreachable, once', async () => {
  const { controller, unreachable, probes } = watch(() => Promise.reject(new Error('cut off')));
  await sleep(STALL_MS * 4);
  controller.abort();
  assert.equal(probes(), 1);
  assert.deepEqual(
    unreachable.map((e) => e.message),
    ['cut off'],
  );
});

test("no pass committed, PostgreSQL answers, but none of the leader's sessions is at work there: stepped down, once", async () => {
  const { controller, unreachable, probes } = watch(() => Promise.resolve('sessions-lost'));
  await sleep(STALL_MS * 4);
  controller.abort();
  assert.equal(probes(), 1);
  assert.equal(unreachable.length, 1);
});

test("no pass committed but PostgreSQL answers and the leader's sessions work: still leading, probed again only a limit later", async () => {
  const { controller, unreachable, probes } = watch(() => Promise.resolve('answering'));
  await sleep(STALL_MS * 3 + STALL_MS / 2);
  controller.abort();
  assert.deepEqual(unreachable, []);
  // At ≈200, ≈400 and ≈600 ms: once per limit, not at every tick of the watch.
  assert.ok(probes() >= 2 && probes() <= 3, `${probes()} probes`);
});

test('a probe still waiting when the epoch ends reports nothing; the watch stops with its epoch', async () => {
  let fail!: (err: Error) => void;
  const { controller, unreachable, probes } = watch(
    () => new Promise<Verdict>((_resolve, reject) => (fail = reject)),
  );
  await sleep(STALL_MS * 2);
  assert.equal(probes(), 1, 'one probe at a time');
  controller.abort();
  fail(new Error('cut off'));
  await sleep(STALL_MS * 2);
  assert.deepEqual(unreachable, []);
  assert.equal(probes(), 1);
});

test('a dispatch that commits while the probe is out ends the stall: its verdict is not acted on', async () => {
  let answer!: (verdict: Verdict) => void;
  const { w, controller, unreachable, probes } = watch(
    () => new Promise<Verdict>((resolve) => (answer = resolve)),
  );
  await sleep(STALL_MS * 1.5);
  assert.equal(probes(), 1);
  w.progressed();
  // The leader's sessions went idle once the lock was gone: the late look finds none at work.
  answer('sessions-lost');
  await sleep(STALL_MS / 2);
  controller.abort();
  assert.deepEqual(unreachable, []);
});
