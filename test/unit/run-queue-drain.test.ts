import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { DbClock } from '../../src/execution/db-clock.js';
import { RunQueue } from '../../src/execution/run-queue.js';
import type { RunMessage } from '../../src/execution/run-message.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { MovableClock } from '../support/run-queue.js';

// A call that a draining queue lets start must be able to end before the drain cuts it (a call cut
// after it reached the target is made again elsewhere). The fake `run` applies attempt.ts's rule
// (whyNotStart): the call starts only if drainLeftMs() > timeoutMs and its signal is not aborted,
// and then lasts its timeout unless aborted.

const RUN_ID = '00000000-0000-4000-8000-000000000001';

interface Call {
  admitted: boolean;
  cut: boolean;
  afterDrain: boolean;
}

function harness(options: {
  clock: DbClock;
  claim?: (message: RunMessage) => Promise<ClaimedRun>;
  drained: () => boolean;
}) {
  const calls: Call[] = [];
  const handedOff: RunMessage[] = [];
  const queue = new RunQueue({
    claim: async (message) => ({ kind: 'claimed', run: await options.claim!(message) }),
    claimLeadMs: 0,
    claimGraceMs: 0,
    concurrency: 4,
    prefetch: 100,
    clock: options.clock,
    run: async (run, signal, drainLeftMs) => {
      const call: Call = {
        admitted: !signal.aborted && (drainLeftMs === undefined || drainLeftMs() > run.timeoutMs),
        cut: false,
        afterDrain: options.drained(),
      };
      calls.push(call);
      if (!call.admitted) return; // attempt.ts hands the claim back
      // The executor: the call ends at its timeout at the latest, or when `signal` aborts it.
      await sleep(run.timeoutMs, undefined, { signal }).catch(() => (call.cut = true));
    },
    handOff: (messages) => handedOff.push(...messages),
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics: createMetrics('test'),
  });
  return { queue, calls, handedOff };
}

test('a run the poller claimed while the drain found the queue idle does not start a call after the drain', async () => {
  // Worker.stop(): the poller is inside claimOverdue (slots reserved) when the drain begins. Nothing
  // is held or executing, so drain() resolves at once and ends the claim watch; the poll then
  // hands its run to execute(), which runs it with the drain deadline still seconds ahead and a
  // signal nobody will abort. Worker.stop() then closes the executor (agent.destroy), cutting the
  // call: reported 'failed' (an attempt charged) after it may have reached the target.
  let drained = false;
  const clock = new DbClock();
  const { queue, calls } = harness({ clock, drained: () => drained });
  const releaseSlots = queue.reserve(1); // the poll is claiming
  const drain = queue.drain(5_000, new Error('worker is stopping')).then(() => (drained = true));
  await sleep(20);
  queue.execute({ ...fakeClaimedRun(RUN_ID, 1), timeoutMs: 100 }); // the poll's claim came back
  releaseSlots();
  await drain;
  await sleep(150);
  assert.equal(calls.length, 1);
  const [call] = calls;
  assert.ok(
    !(call!.admitted && call!.afterDrain),
    'a call was started after drain() had resolved (claim watch ended, nothing will abort it but the executor close)',
  );
});

test('a call admitted during the drain is not cut when the clock estimate moves back meanwhile', async () => {
  // The drain aborts on a monotonic timer; a re-sync of the database clock estimate during the drain
  // (RunClaimer.afterMiss, or a poll's sync in flight at stop; large when the start-up sync failed
  // and the offset was assumed 0) must not change the time left that attempt.ts is given. (It did
  // when that was a database-clock instant compared with clock.now().)
  let drained = false;
  const clock = new MovableClock();
  const { queue, calls } = harness({
    clock,
    drained: () => drained,
    // The claim round trip takes 100 ms (a slow batch), during which the estimate is re-synced.
    claim: async () => {
      await sleep(100);
      // Due now by the database clock (the claim's not_before <= now()).
      return { ...fakeClaimedRun(RUN_ID, 1), timeoutMs: 650, notBefore: new Date(clock.now()) };
    },
  });
  queue.hold({ runId: RUN_ID, jobId: RUN_ID, attempt: 1, scheduledFor: new Date(), notBefore: new Date() });
  const drain = queue.drain(600, new Error('worker is stopping')).then(() => (drained = true));
  await sleep(50);
  clock.shiftMs = -300; // a re-sync: our estimate of the database clock was 300 ms fast
  await drain;
  assert.equal(calls.length, 1);
  const [call] = calls;
  // Started ~100 ms into a 600 ms drain with a 650 ms timeout: it cannot end in time, yet the
  // shifted estimate says 800 ms are left.
  assert.ok(!(call!.admitted && call!.cut), 'a call the drain let start was cut by the drain');
});

test('a draining queue hands over, unclaimed, the held runs due after its deadline or whose announced timeout cannot end before it', async () => {
  const claimed: string[] = [];
  const clock = new DbClock();
  const { queue, calls, handedOff } = harness({
    clock,
    drained: () => false,
    claim: async (message) => {
      claimed.push(message.runId);
      return {
        ...fakeClaimedRun(message.runId, 1),
        timeoutMs: message.timeoutMs!,
        notBefore: message.notBefore,
      };
    },
  });
  const held = (n: number, dueInMs: number, timeoutMs: number): RunMessage => {
    const at = new Date(clock.now() + dueInMs);
    const runId = `00000000-0000-4000-8000-00000000000${n}`;
    return { runId, jobId: runId, attempt: 1, scheduledFor: at, notBefore: at, timeoutMs };
  };
  queue.hold(held(2, 100, 200)); // ends by 300 ms: fits a 500 ms drain
  queue.hold(held(3, 100, 1000)); // would end at 1.1 s: left for another node, not claimed
  queue.hold(held(4, 2000, 100)); // due after the deadline
  await queue.drain(500, new Error('worker is stopping'));
  assert.deepEqual(claimed, ['00000000-0000-4000-8000-000000000002']);
  assert.deepEqual(
    handedOff.map((m) => m.runId),
    ['00000000-0000-4000-8000-000000000003', '00000000-0000-4000-8000-000000000004'],
  );
  assert.equal(calls.filter((c) => c.admitted && !c.cut).length, 1);
});
