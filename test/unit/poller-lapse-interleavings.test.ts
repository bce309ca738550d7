import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { dueAnnouncement, stalledPoll, testRunQueue } from '../support/run-queue.js';

const id = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

test('a drain that begins while a lapsed poll is out: its claims, arriving after the drain ended, are handed back with the stop reason, never called', async () => {
  const calls: { runId: string; aborted: unknown }[] = [];
  const queue = testRunQueue({
    run: async (run, signal, _drainLeft, callEnded) => {
      calls.push({ runId: run.id, aborted: signal.aborted ? signal.reason : false });
      callEnded(!signal.aborted);
    },
  });
  const poll = stalledPoll(queue, [fakeClaimedRun(id(1)), fakeClaimedRun(id(2))]);
  await sleep(100);
  const reason = new Error('stopping');
  await queue.drain(1000, reason);
  poll.answer();
  poll.stop();
  await poll.done;
  await sleep(20);
  assert.deepEqual(calls, [
    { runId: id(1), aborted: reason },
    { runId: id(2), aborted: reason },
  ]);
});

test('the lapse and the answer in every order: never more calls than slots, every claim called once', async () => {
  for (const answerAfterMs of [0, 50, 55, 100]) {
    let running = 0;
    let most = 0;
    const called: string[] = [];
    const queue = testRunQueue({
      run: async (run, _signal, _drainLeft, callEnded) => {
        called.push(run.id);
        running += 1;
        most = Math.max(most, running);
        await sleep(30);
        running -= 1;
        callEnded(true);
      },
    });
    const poll = stalledPoll(queue, [fakeClaimedRun(id(1)), fakeClaimedRun(id(2))]);
    // Announced runs fall due while the poll is out.
    for (const n of [3, 4, 5]) queue.hold(dueAnnouncement(id(n), new Date(Date.now() + 40)));
    await sleep(answerAfterMs);
    poll.answer();
    await sleep(200);
    poll.stop();
    await poll.done;
    await queue.drain(1000, new Error('test over'));
    assert.ok(most <= 2, `${most} calls at once (answer after ${answerAfterMs} ms)`);
    assert.deepEqual([...called].sort(), [1, 2, 3, 4, 5].map(id), `answer after ${answerAfterMs} ms`);
  }
});
