import assert from 'node:assert/strict';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { attemptsOf, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { apiCall } from '../support/node-api.js';

// README, "Delivery to the target": a retry after a failure (non-2xx, timeout, connection error)
// is a new attempt with the same Idempotency-Key. A non-2xx is in execution-retries.test.ts; here
// the other two, end to end: a call that times out, and a connection the target resets.

let fixture: IntegrationFixture;
let api: string;
/** Resets the connection of the first request of each run (no response at all), answers later ones. */
let resetting: Server;
const resetCalls: { runId: string; key: string; attempt: number }[] = [];

before(async () => {
  fixture = await integrationFixture({
    // The first call of each run hangs (past the job's timeout); later ones answer.
    behaviour: (_request, nth) => (nth === 1 ? { hang: true } : { status: 200 }),
  });
  resetting = createServer((req, res) => {
    const runId = String(req.headers['x-helios-run-id']);
    resetCalls.push({
      runId,
      key: String(req.headers['idempotency-key']),
      attempt: Number(req.headers['x-helios-attempt']),
    });
    if (resetCalls.filter((c) => c.runId === runId).length === 1) req.socket.destroy();
    else res.end('ok');
  });
  await new Promise<void>((resolve) => resetting.listen(0, '127.0.0.1', resolve));
  api = (await fixture.start('retry-causes-1')).apiUrl;
});
after(async () => {
  resetting.closeAllConnections();
  await new Promise<void>((resolve) => resetting.close(() => resolve()));
  await fixture.teardown();
});

/** Triggers a run of a new job aimed at `url` and waits until it ends; returns the run id. */
async function runOnce(url: string, timeoutMs: number): Promise<string> {
  const job = await apiCall<{ id: string }>(api, 'POST', '/jobs', {
    name: `retry-causes-${uniqueId()}`,
    schedule: '0 0 1 1 *', // never during the test: one manual run
    target: { url, method: 'POST' },
    timeoutMs,
    retry: { maxAttempts: 3, backoffMs: 100 },
  });
  const { runId } = await apiCall<{ runId: string }>(api, 'POST', `/jobs/${job.id}/trigger`);
  await waitFor(
    'the run to end',
    async () => {
      const run = await apiCall<{ state: string }>(api, 'GET', `/runs/${runId}`);
      return !['queued', 'running'].includes(run.state);
    },
    20_000,
  );
  return runId;
}

test('a call that times out is retried: a new attempt with the same Idempotency-Key', async () => {
  const runId = await runOnce(`${fixture.target.url}/hang-once`, 500);
  const run = await apiCall<{ state: string }>(api, 'GET', `/runs/${runId}`);
  assert.equal(run.state, 'succeeded');
  const attempts = await attemptsOf(fixture.db.pool, runId);
  assert.deepEqual(
    attempts.map((a) => [a.attempt, a.outcome]),
    [
      [1, 'timeout'],
      [2, 'succeeded'],
    ],
  );
  const calls = fixture.target.requests.filter((r) => r.runId === runId);
  assert.deepEqual(
    calls.map((c) => [c.attempt, c.idempotencyKey]),
    [
      [1, runId],
      [2, runId],
    ],
  );
});

test('a connection the target resets is retried: a new attempt with the same Idempotency-Key', async () => {
  const { port } = resetting.address() as AddressInfo;
  const runId = await runOnce(`http://127.0.0.1:${port}/reset-once`, 5000);
  const run = await apiCall<{ state: string }>(api, 'GET', `/runs/${runId}`);
  assert.equal(run.state, 'succeeded');
  const attempts = await attemptsOf(fixture.db.pool, runId);
  assert.deepEqual(
    attempts.map((a) => [a.attempt, a.outcome]),
    [
      [1, 'failed'],
      [2, 'succeeded'],
    ],
  );
  assert.ok(attempts[0]!.error, 'the failed attempt records the connection error');
  assert.deepEqual(
    resetCalls.filter((c) => c.runId === runId).map((c) => [c.attempt, c.key]),
    [
      [1, runId],
      [2, runId],
    ],
  );
});
