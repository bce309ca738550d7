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

// A stopping worker keeps executing the runs it holds that fall due during its drain (so a rolling
// restart does not make them late), but only those whose call can end before the drain deadline:
// a call the drain started and then cut at the deadline may have reached the target already, and
// the run handed back was called a second time by another node (the rolling restart in CI: a run
// due a few ms before the deadline, called twice).

let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture({
    // `/slow` answers after a second, anything else at once.
    behaviour: (request) => (request.path === '/slow' ? { status: 200, delayMs: 1000 } : { status: 200 }),
  });
});
after(() => fx.teardown());

test(
  'a stopping worker calls a held run only if the call can end before its drain deadline; the other is handed back, called once',
  { timeout: 90_000 },
  async () => {
    const leader = fx.spawn('drain-leader', { HELIOS_ROLES: 'scheduler' });
    // The only worker while the runs are announced: it holds both. HELIOS_SHUTDOWN_TIMEOUT_MS is
    // 3000 in tests, so its drain ends 2 s after SIGTERM.
    const stopping = fx.spawn('drain-stopping', { HELIOS_ROLES: 'worker' });
    await leader.waitForLog((l) => l.msg === 'became leader', 30_000);
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
    // Another worker to take over what the stopping one hands back.
    fx.spawn('drain-next', { HELIOS_ROLES: 'worker' });
    assert.equal((await stopping.exited).code, 0);

    const settled = async (jobId: string) => (await runsOf(fx.db.pool, jobId))[0]?.state === 'succeeded';
    await waitFor('both runs to succeed', async () => (await settled(fits)) && (await settled(late)), 30_000);

    // The run that fitted was called once, by the stopping worker, during its drain.
    const [fitsRun] = await runsOf(fx.db.pool, fits);
    assert.deepEqual(
      (await attemptsOf(fx.db.pool, fitsRun!.id)).map((a) => [a.attempt, a.nodeId, a.outcome]),
      [[1, 'drain-stopping', 'succeeded']],
    );
    assert.equal(fx.target.forJob(fits).length, 1);

    // The other was claimed by the stopping worker, handed back without a call, and called once,
    // elsewhere, at its second attempt (the hand-back cost no attempt: maxAttempts was 1).
    const [lateRun] = await runsOf(fx.db.pool, late);
    const attempts = await attemptsOf(fx.db.pool, lateRun!.id);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
      [
        [1, 'drain-stopping', 'cancelled'],
        [2, 'drain-next', 'succeeded'],
      ],
    );
    const calls = fx.target.forJob(late);
    assert.deepEqual(
      calls.map((c) => [c.attempt, c.aborted ?? false]),
      [[2, false]],
      'one call, by the next worker, never one cut by the drain',
    );
    assert.ok(calls[0]!.arrivedAt >= at.getTime(), 'handed back, the run was still not called early');
  },
);
