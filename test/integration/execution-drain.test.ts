import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import {
  attemptsOf,
  insertJob,
  nextWholeSecond,
  oncePerMinuteAt,
  runsOf,
  waitFor,
} from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';

// A stopping worker keeps executing the runs it holds that fall due during its drain, but only those
// whose call can end before the drain deadline: a call the drain started and then cut at the
// deadline may have reached the target already, and the run handed back was called a second time
// by another node (the rolling restart in CI: a run due a few ms before the deadline, called
// twice). The others it hands over to another worker (NOTIFY helios_handoff), so a rolling restart
// does not make them late.

let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture({
    // `/slow` answers after a second; `/status-first` sends its status at once and, on a run's
    // first call, its body 20 s later; anything else answers at once.
    behaviour: (request, nth) => {
      if (request.path === '/slow') return { status: 200, delayMs: 1000 };
      if (request.path === '/status-first' && nth === 1) return { status: 200, bodyAfterMs: 20_000 };
      return { status: 200 };
    },
  });
  const leader = fx.spawn('drain-leader', { HELIOS_ROLES: 'scheduler' });
  await leader.waitForLog((l) => l.msg === 'became leader', 30_000);
});
after(() => fx.teardown());

/**
 * One stopping worker holding two runs: `fits` (due 1 s before `at`, timeout 500 ms) and `late`
 * (due at `at`, ≈0.1 s before the drain deadline, a call of a second, timeout 5 s). SIGTERM at
 * `at` − 1.9 s. A peer worker consumes another topic, so it can reach these runs only through what
 * the stopping one hands over (or, ≥ 2 s late, through polling). Returns both runs' attempts and
 * calls.
 */
async function stopWhileHolding(name: string, extraEnv: Record<string, string> = {}) {
  const peer = fx.spawn(`${name}-peer`, {
    HELIOS_ROLES: 'worker',
    HELIOS_KAFKA_TOPIC: `${fx.topic}.quiet`,
    HELIOS_KAFKA_DLQ_TOPIC: `${fx.topic}.quiet.dlq`,
    HELIOS_KAFKA_GROUP: `${fx.topic}.quiet.workers`,
  });
  const stopping = fx.spawn(name, { HELIOS_ROLES: 'worker', ...extraEnv });
  await peer.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
  await stopping.waitForLog((l) => l.msg === 'joined consumer group', 30_000);

  const at = await nextWholeSecond(fx.db.pool, 3500);
  // Due 1 s before `at`, i.e. ≈0.9 s into the drain: its 500 ms timeout fits, so it runs here.
  const early = new Date(at.getTime() - 1000);
  const fits = await insertJob(fx.db.pool, {
    name: `drain-fits-${uniqueId()}`,
    schedule: oncePerMinuteAt(early),
    target: { url: `${fx.target.url}/ok` },
    nextRunAt: early,
    timeoutMs: 500,
    maxAttempts: 1,
  });
  // Due ≈0.1 s before the drain deadline, its call takes a second: cut at the deadline if started.
  const late = await insertJob(fx.db.pool, {
    name: `drain-late-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${fx.target.url}/slow` },
    nextRunAt: at,
    timeoutMs: 5000,
    maxAttempts: 1,
  });
  await fx.db.pool.query('NOTIFY helios_jobs');

  await sleep(at.getTime() - 1900 - Date.now());
  stopping.signal('SIGTERM');
  assert.equal((await stopping.exited).code, 0);

  const settled = async (jobId: string) => (await runsOf(fx.db.pool, jobId))[0]?.state === 'succeeded';
  await waitFor('both runs to succeed', async () => (await settled(fits)) && (await settled(late)), 30_000);
  const history = async (jobId: string) => {
    const [run] = await runsOf(fx.db.pool, jobId);
    const attempts = await attemptsOf(fx.db.pool, run!.id);
    return {
      attempts: attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
      calls: fx.target.forJob(jobId).map((c) => [c.attempt, c.aborted ?? false]),
      firstCallAt: fx.target.forJob(jobId)[0]?.arrivedAt ?? NaN,
    };
  };
  const result = { at, fits: await history(fits), late: await history(late) };
  // The next test starts from a cluster with no worker.
  peer.signal('SIGTERM');
  await peer.exited;
  return result;
}

test(
  'a stopping worker calls a held run only if its timeout ends before the drain deadline, and hands the other over unclaimed',
  { timeout: 90_000 },
  async () => {
    const { at, fits, late } = await stopWhileHolding('drain-a');
    // The run that fitted was called once, by the stopping worker, during its drain.
    assert.deepEqual(fits.attempts, [[1, 'drain-a', 'succeeded']]);
    assert.deepEqual(fits.calls, [[1, false]]);
    // The other (its timeout announced with it) was not even claimed but handed over: called once,
    // by the peer, at its first attempt, on time (polling would have taken it ≥ 2 s late).
    assert.deepEqual(late.attempts, [[1, 'drain-a-peer', 'succeeded']]);
    assert.deepEqual(late.calls, [[1, false]]);
    assert.ok(late.firstCallAt >= at.getTime(), 'not called early');
    assert.ok(
      late.firstCallAt - at.getTime() < 1000,
      `handed over, called ${late.firstCallAt - at.getTime()} ms late`,
    );
  },
);

test(
  'a run claimed ahead whose call cannot end before the drain deadline is handed back uncalled and over, and called once elsewhere',
  { timeout: 90_000 },
  async () => {
    // A claim lead longer than the time to SIGTERM: both runs are claimed before the drain begins.
    const { at, fits, late } = await stopWhileHolding('drain-b', { HELIOS_CLAIM_LEAD_MS: '3000' });
    assert.deepEqual(fits.attempts, [[1, 'drain-b', 'succeeded']]);
    assert.deepEqual(fits.calls, [[1, false]]);
    // Handed back at its time, uncalled, at no cost (maxAttempts was 1), and handed over: the
    // peer's call is the only one, at attempt 2. Before: called at its time, cut by the drain
    // ≈0.1 s later, and called again elsewhere.
    assert.deepEqual(late.attempts, [
      [1, 'drain-b', 'cancelled'],
      [2, 'drain-b-peer', 'succeeded'],
    ]);
    assert.deepEqual(late.calls, [[2, false]], 'one call, by the peer, never one cut by the drain');
    assert.ok(late.firstCallAt >= at.getTime(), 'handed back, the run was still not called early');
    assert.ok(
      late.firstCallAt - at.getTime() < 1000,
      `handed over, called ${late.firstCallAt - at.getTime()} ms late`,
    );
  },
);

test(
  'a call the drain cuts after the target answered 2xx is recorded as succeeded, not handed back and made again',
  { timeout: 90_000 },
  async () => {
    const name = 'drain-c';
    const peer = fx.spawn(`${name}-peer`, {
      HELIOS_ROLES: 'worker',
      HELIOS_KAFKA_TOPIC: `${fx.topic}.quiet`,
      HELIOS_KAFKA_DLQ_TOPIC: `${fx.topic}.quiet.dlq`,
      HELIOS_KAFKA_GROUP: `${fx.topic}.quiet.workers`,
    });
    const stopping = fx.spawn(name, { HELIOS_ROLES: 'worker', HELIOS_SHUTDOWN_TIMEOUT_MS: '1000' });
    await peer.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
    await stopping.waitForLog((l) => l.msg === 'joined consumer group', 30_000);

    const at = await nextWholeSecond(fx.db.pool, 2500);
    const job = await insertJob(fx.db.pool, {
      name: `drain-answered-${uniqueId()}`,
      schedule: oncePerMinuteAt(at),
      target: { url: `${fx.target.url}/status-first` },
      nextRunAt: at,
      timeoutMs: 30_000,
      maxAttempts: 3,
    });
    await fx.db.pool.query('NOTIFY helios_jobs');
    // The target has answered 200 (its body still to come) when the worker is told to stop.
    await waitFor('the call to arrive', () => fx.target.forJob(job).length === 1, 15_000);
    await sleep(200);
    stopping.signal('SIGTERM');
    assert.equal((await stopping.exited).code, 0);

    const [run] = await runsOf(fx.db.pool, job);
    assert.equal(run?.state, 'succeeded');
    const attempts = await attemptsOf(fx.db.pool, run.id);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
      [[1, name, 'succeeded']],
    );
    // Handed back instead (before), the peer called it a second time.
    await sleep(3000);
    assert.deepEqual(
      fx.target.forJob(job).map((c) => c.attempt),
      [1],
    );
    peer.signal('SIGTERM');
    await peer.exited;
  },
);
