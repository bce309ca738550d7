import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { attemptsOf, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { apiCall } from '../support/node-api.js';
import { startTogether } from '../support/start-together.js';

// README, "A worker's failure is not the target's" and "Execution is claimed before it happens":
// a worker that froze (SIGSTOP) during a call loses its claim when it expires; the run is re-queued
// without using up an attempt (so a `maxAttempts: 1` run still runs, on another worker), and when
// the frozen worker wakes up with its answer, its completion is conditional on a claim it no
// longer holds and changes nothing.

let fixture: IntegrationFixture;
let api: string;

before(async () => {
  fixture = await integrationFixture({
    // Every call is answered after 1.5 s: the first while its worker is frozen, the second after
    // the frozen worker has woken up and tried to settle the first.
    behaviour: () => ({ status: 200, delayMs: 1500 }),
  });
  // A short grace: a claim expires 1 s after the run's 2 s timeout.
  const worker = { HELIOS_ROLES: 'worker', HELIOS_CLAIM_GRACE_MS: '1000' };
  // Started together (a node takes seconds to boot on a busy machine).
  const [leader] = await startTogether(fixture, [
    { name: 'frozen-leader', extra: { HELIOS_ROLES: 'scheduler,api' }, wait: { leader: true } },
    { name: 'frozen-w1', extra: worker, wait: { worker: true } },
    { name: 'frozen-w2', extra: worker, wait: { worker: true } },
  ]);
  api = leader!.apiUrl;
});
after(async () => {
  for (const node of fixture.nodes) node.signal('SIGCONT');
  await fixture.teardown();
});

test(
  'a worker frozen mid-call: the run is re-queued without an attempt and runs on another worker; the late completion changes nothing',
  { timeout: 60_000 },
  async () => {
    const job = await apiCall<{ id: string }>(api, 'POST', '/jobs', {
      name: `frozen-${uniqueId()}`,
      schedule: '0 0 1 1 *', // never during the test: one manual run
      target: { url: `${fixture.target.url}/frozen`, method: 'POST' },
      timeoutMs: 2000,
      retry: { maxAttempts: 1, backoffMs: 100 },
    });
    const { runId } = await apiCall<{ runId: string }>(api, 'POST', `/jobs/${job.id}/trigger`);
    await waitFor('the first call', () => fixture.target.requests.some((r) => r.runId === runId));
    const [first] = await attemptsOf(fixture.db.pool, runId);
    const frozen = fixture.nodes.find((n) => n.name === first!.nodeId)!;
    frozen.signal('SIGSTOP');

    // The claim expires; the reaper re-queues the run and the other worker calls it again.
    await waitFor(
      'the second call, by the other worker',
      () => fixture.target.requests.filter((r) => r.runId === runId).length >= 2,
      30_000,
    );
    // Woken while the other worker's attempt is running: the frozen worker's answer (or its
    // timeout) must not settle that attempt.
    frozen.signal('SIGCONT');
    await frozen
      .waitForLog(
        (l) =>
          l.run === runId &&
          (l.msg === 'completion discarded: the claim had been lost' || l.msg === 'call aborted: claim lost'),
        20_000,
      )
      .catch(async () => {
        const { rows } = await fixture.db.pool.query(
          'SELECT state, attempt, claimed_by FROM runs WHERE id = $1',
          [runId],
        );
        const attempts = await attemptsOf(fixture.db.pool, runId);
        assert.fail(
          `the woken worker did not find its claim gone; run ${JSON.stringify(rows[0])}, attempts ${JSON.stringify(
            attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
          )}`,
        );
      });
    const ended = await waitFor(
      'the run to end',
      async () => {
        const run = await apiCall<{ state: string; attempt: number }>(api, 'GET', `/runs/${runId}`);
        return ['queued', 'running'].includes(run.state) ? null : run;
      },
      20_000,
    );
    assert.deepEqual(
      [ended.state, ended.attempt],
      ['succeeded', 2],
      'the expiry was not charged as the one attempt, and the late completion changed nothing',
    );

    const attempts = await attemptsOf(fixture.db.pool, runId);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.nodeId === frozen.name ? 'frozen' : 'other', a.outcome]),
      [
        [1, 'frozen', 'expired'],
        [2, 'other', 'succeeded'],
      ],
    );
    const calls = fixture.target.requests.filter((r) => r.runId === runId);
    assert.deepEqual(
      calls.map((c) => [c.attempt, c.idempotencyKey]),
      [
        [1, runId],
        [2, runId],
      ],
      'called twice (its worker froze during the call), with the same Idempotency-Key',
    );
  },
);
