import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { apiCall } from '../support/node-api.js';

// `forbid` skips a fresh occurrence while another run of the job is active. A retry or a replay is
// not a fresh occurrence: skipping it would lose a run without a dead letter. It waits its turn.

const failing = new Set<string>();
const slow = new Set<string>();
let fx: IntegrationFixture;
let api: string;

const call = <T>(method: string, path: string, body?: unknown) => apiCall<T>(api, method, path, body);

async function run(id: string) {
  const { rows } = await fx.db.pool.query<{ state: string; reason: string | null; attempt: number }>(
    'SELECT state, reason, attempt FROM runs WHERE id = $1',
    [id],
  );
  return rows[0]!;
}

before(async () => {
  fx = await integrationFixture({
    behaviour: (request, nth) => {
      if (failing.has(request.runId) && nth === 1) return { status: 500 };
      if (slow.has(request.runId)) return { status: 200, delayMs: 3000 };
      return { status: 200 };
    },
  });
  api = (await fx.start('forbid-1')).apiUrl;
});
after(() => fx.teardown());

test('forbid: a dead-letter replay while another run of the job runs waits its turn and runs', async () => {
  const job = await call<{ id: string }>('POST', '/jobs', {
    name: `forbid-replay-${uniqueId()}`,
    schedule: '0 0 1 1 *', // never during the test: only manual runs
    target: { url: `${fx.target.url}/forbid-replay`, method: 'POST' },
    concurrency: 'forbid',
    retry: { maxAttempts: 1, backoffMs: 100 },
  });
  // A run that fails its only attempt: dead, with an open dead letter.
  const dead = await call<{ runId: string }>('POST', `/jobs/${job.id}/trigger`);
  failing.add(dead.runId);
  await waitFor('the first run to be dead', async () => (await run(dead.runId)).state === 'dead');
  // Another run of the job, whose call takes 3 s.
  const busy = await call<{ runId: string }>('POST', `/jobs/${job.id}/trigger`);
  slow.add(busy.runId);
  await waitFor('the slow run to reach the target', () =>
    fx.target.requests.some((r) => r.runId === busy.runId),
  );
  const letters = await call<{ items: { id: string; runId: string }[] }>('GET', '/dead-letters?open=true');
  const letter = letters.items.find((l) => l.runId === dead.runId)!;
  await call('POST', `/dead-letters/${letter.id}/replay`);

  const replayed = await waitFor(
    'the replayed run to finish',
    async () => {
      const state = await run(dead.runId);
      return ['succeeded', 'skipped', 'dead', 'failed'].includes(state.state) ? state : null;
    },
    20_000,
  );
  assert.equal(replayed.state, 'succeeded', `the replay ended ${replayed.state} (${replayed.reason})`);
  const busyCall = fx.target.requests.find((r) => r.runId === busy.runId)!;
  const replayCall = fx.target.requests.filter((r) => r.runId === dead.runId)[1]!;
  assert.ok(replayCall, 'the replay reached the target');
  assert.ok(
    replayCall.arrivedAt >= busyCall.endedAt!,
    'the replay started only after the other run of the forbid job ended',
  );
});
