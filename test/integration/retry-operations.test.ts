import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { attemptsOf, nextWholeSecond, oncePerMinuteAt, runsOf, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { parseMetrics } from '../support/metrics.js';
import { apiCall } from '../support/node-api.js';

// What users do to a job while one of its runs waits in its retry back-off, has its call in
// flight, or has just gone dead (DESIGN.md items 7 and 10; README, Guarantees): pause, PATCH,
// delete, trigger and replay, against the concurrency policies. Real nodes, real servers.

let fx: IntegrationFixture;
let api: string;

/**
 * Paths whose calls fail: `/fail` always, `/once` each run's first call, `/first` only the first
 * call the path receives; `/slow` answers 200 after 3 s, `/hang` never, `/slow-once` fails each run's first call after 1.5 s.
 */
const firstCalled = new Set<string>();
const behaviour = (request: { path: string }, nth: number) => {
  if (request.path.endsWith('/fail')) return { status: 500, body: 'failing' };
  if (request.path.endsWith('/slow')) return { status: 200, delayMs: 3000 };
  if (request.path.endsWith('/hang')) return { hang: true };
  if (request.path.endsWith('/slow-once'))
    return { status: nth === 1 ? 500 : 200, delayMs: nth === 1 ? 1500 : 0 };
  if (request.path.endsWith('/once')) return { status: nth === 1 ? 500 : 200 };
  if (request.path.endsWith('/first') && !firstCalled.has(request.path)) {
    firstCalled.add(request.path);
    return { status: 500 };
  }
  return { status: 200 };
};

before(async () => {
  fx = await integrationFixture({ behaviour });
  api = (await fx.start('retry-ops')).apiUrl;
});
after(() => fx.teardown());

interface JobAnswer {
  id: string;
  enabled: boolean;
  updatedAt: string;
}

const call = <T = JobAnswer>(method: string, path: string, body?: unknown) =>
  apiCall<T>(api, method, path, body);

/** A job (through the API) that fires only when triggered (its schedule: once a year). */
async function triggeredJob(path: string, fields: Record<string, unknown>): Promise<string> {
  const job = await call('POST', '/jobs', {
    name: `${path.replaceAll('/', '')}-${uniqueId()}`,
    schedule: '0 0 0 1 1 *',
    target: { url: `${fx.target.url}${path}` },
    timeoutMs: 5000,
    ...fields,
  });
  return job.id;
}

const trigger = async (jobId: string) =>
  (await call<{ runId: string }>('POST', `/jobs/${jobId}/trigger`)).runId;

/** Calls the target received for a run, in order of arrival. */
const callsOf = (runId: string) =>
  fx.target.requests.filter((r) => r.runId === runId).sort((a, b) => a.arrivedAt - b.arrivedAt);

async function runOf(jobId: string, runId: string) {
  return (await runsOf(fx.db.pool, jobId)).find((r) => r.id === runId);
}

/**
 * Whether a run waits in its retry back-off: queued after a call. A run not yet claimed is queued
 * at attempt 1 too (the attempt counts up when the retry is claimed), so the state alone does not
 * tell them apart.
 */
const inBackoff = (run: { id: string; state: string } | undefined) =>
  run?.state === 'queued' && callsOf(run.id).length > 0;

async function openDeadLetterOf(runId: string): Promise<string> {
  return waitFor('the dead letter', async () => {
    const { rows } = await fx.db.pool.query<{ id: string }>(
      'SELECT id FROM dead_letters WHERE run_id = $1 AND replayed_at IS NULL',
      [runId],
    );
    return rows[0]?.id;
  });
}

test(
  'a replayed run retries with the back-off of a fresh budget: its first retry waits backoffMs',
  { timeout: 60_000 },
  async () => {
    // 500 ms, then 4 × that: the budget of two attempts is used up within a second.
    const jobId = await triggeredJob('/replay-backoff/fail', {
      retry: { maxAttempts: 2, backoffMs: 500, backoffMultiplier: 4 },
    });
    const runId = await trigger(jobId);
    const letterId = await openDeadLetterOf(runId);
    assert.equal(callsOf(runId).length, 2);

    await call('POST', `/dead-letters/${letterId}/replay`);
    await openDeadLetterOf(runId);
    const calls = callsOf(runId);
    assert.deepEqual(
      calls.map((c) => c.attempt),
      [1, 2, 3, 4],
      'the replay has a fresh budget of two attempts',
    );
    // A fresh budget: its first retry waits backoffMs (+ ≤ 20 % jitter), as the run's first did,
    // not backoffMs × 4² (8 s) as if its attempts were the third and fourth of one budget.
    const firstGap = calls[1]!.arrivedAt - calls[0]!.arrivedAt;
    const replayGap = calls[3]!.arrivedAt - calls[2]!.arrivedAt;
    assert.ok(firstGap >= 500 && firstGap < 1500, `first life's retry after ${firstGap.toFixed(0)} ms`);
    assert.ok(
      replayGap >= 500 && replayGap < 1500,
      `the replay's retry came ${replayGap.toFixed(0)} ms after its first call (backoffMs 500)`,
    );
  },
);

test(
  'replace: a run asked for later replaces an older run waiting in its retry back-off',
  { timeout: 60_000 },
  async () => {
    // The older run's first call fails; its retry would come 4 s later.
    const jobId = await triggeredJob('/replace-backoff/first', {
      concurrency: 'replace',
      retry: { maxAttempts: 3, backoffMs: 4000, backoffMultiplier: 1 },
    });
    const older = await trigger(jobId);
    await waitFor('the older run in its back-off', async () => {
      const run = await runOf(jobId, older);
      return inBackoff(run) && run?.attempt === 1;
    });
    // A newer run is asked for while the older one waits, and succeeds.
    const newer = await trigger(jobId);
    await waitFor(
      'the newer run to succeed',
      async () => (await runOf(jobId, newer))?.state === 'succeeded',
      20_000,
    );
    // Past the older run's retry time (4 s + 20 % jitter after its failure).
    await sleep(5500);
    const run = await runOf(jobId, older);
    const olderCalls = callsOf(older);
    assert.deepEqual(
      olderCalls.map((c) => c.attempt),
      [1],
      `the older run was called again after a newer run was asked for (state ${run?.state}, ${run?.reason})`,
    );
    assert.equal(run?.state, 'failed');
    assert.equal(run?.reason, 'replaced');
  },
);

test(
  'forbid: a trigger while a retry waits is skipped, and the retry still runs',
  { timeout: 60_000 },
  async () => {
    const jobId = await triggeredJob('/forbid-backoff/once', {
      concurrency: 'forbid',
      retry: { maxAttempts: 3, backoffMs: 2000, backoffMultiplier: 1 },
    });
    const first = await trigger(jobId);
    await waitFor('the first run in its back-off', async () => inBackoff(await runOf(jobId, first)));
    const second = await trigger(jobId);
    const skipped = await waitFor('the second run decided', async () => {
      const run = await runOf(jobId, second);
      return run && run.state !== 'queued' ? run : null;
    });
    assert.equal(skipped.state, 'skipped');
    assert.equal(skipped.reason, 'concurrency-forbid');
    await waitFor(
      'the retry to succeed',
      async () => (await runOf(jobId, first))?.state === 'succeeded',
      10_000,
    );
    assert.deepEqual(
      callsOf(first).map((c) => c.attempt),
      [1, 2],
    );
    assert.equal(callsOf(second).length, 0);
  },
);

/** A job whose one occurrence falls due about two seconds from now; its first call fails. */
async function scheduledOnce(path: string, fields: Record<string, unknown> = {}) {
  const at = await nextWholeSecond(fx.db.pool, 1500);
  const job = await call('POST', '/jobs', {
    name: `${path.replaceAll('/', '')}-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${fx.target.url}${path}` },
    timeoutMs: 5000,
    retry: { maxAttempts: 3, backoffMs: 2500, backoffMultiplier: 1 },
    ...fields,
  });
  const run = await waitFor(
    'the occurrence waiting in its back-off',
    async () => {
      const [first] = await runsOf(fx.db.pool, job.id);
      return inBackoff(first) && first?.attempt === 1 ? first : null;
    },
    15_000,
  );
  return { jobId: job.id, runId: run.id, at };
}

test(
  'a pause while an occurrence waits in its back-off: the retry still runs (it fell due while enabled)',
  { timeout: 60_000 },
  async () => {
    const { jobId, runId } = await scheduledOnce('/pause-backoff/once');
    const paused = await call('POST', `/jobs/${jobId}/pause`);
    assert.equal(paused.enabled, false);
    await waitFor(
      'the retry to succeed',
      async () => (await runOf(jobId, runId))?.state === 'succeeded',
      10_000,
    );
    assert.deepEqual(
      callsOf(runId).map((c) => c.attempt),
      [1, 2],
    );
  },
);

test(
  'a PATCH of the target while an occurrence waits in its back-off: the retry calls the target in force when it fell due',
  { timeout: 60_000 },
  async () => {
    const { jobId, runId } = await scheduledOnce('/patch-backoff/once');
    await call('PATCH', `/jobs/${jobId}`, { target: { url: `${fx.target.url}/patched` } });
    await waitFor(
      'the retry to succeed',
      async () => (await runOf(jobId, runId))?.state === 'succeeded',
      10_000,
    );
    assert.deepEqual(
      callsOf(runId).map((c) => [c.attempt, c.path]),
      [
        [1, '/patch-backoff/once'],
        [2, '/patch-backoff/once'],
      ],
    );
    await call('POST', `/jobs/${jobId}/pause`);
  },
);

test(
  'a delete while an occurrence waits in its back-off: no retry call, nothing of the job left',
  { timeout: 60_000 },
  async () => {
    const { jobId, runId } = await scheduledOnce('/delete-backoff/fail');
    const response = await fetch(`${api}/api/v1/jobs/${jobId}`, {
      method: 'DELETE',
      headers: { 'content-type': 'application/json' },
      body: '{}',
    });
    assert.equal(response.status, 204);
    await sleep(4000); // past the retry's time (2.5 s + 20 % jitter)
    assert.equal(callsOf(runId).length, 1);
    const { rows } = await fx.db.pool.query<{ n: number }>(
      `SELECT (SELECT count(*) FROM runs WHERE job_id = $1)::int
            + (SELECT count(*) FROM dead_letters WHERE job_id = $1)::int
            + (SELECT count(*) FROM run_attempts WHERE run_id = $2)::int AS n`,
      [jobId, runId],
    );
    assert.equal(rows[0]!.n, 0);
  },
);

test(
  "a replay of a paused job's dead letter calls it (an operator's explicit request)",
  { timeout: 60_000 },
  async () => {
    const jobId = await triggeredJob('/replay-paused/once', {
      retry: { maxAttempts: 1, backoffMs: 100 },
    });
    const runId = await trigger(jobId);
    const letterId = await openDeadLetterOf(runId);
    await call('POST', `/jobs/${jobId}/pause`);
    await call('POST', `/dead-letters/${letterId}/replay`);
    await waitFor(
      'the replayed run to succeed',
      async () => (await runOf(jobId, runId))?.state === 'succeeded',
      10_000,
    );
    const attempts = await attemptsOf(fx.db.pool, runId);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.outcome]),
      [
        [1, 'failed'],
        [2, 'succeeded'],
      ],
    );
  },
);

test(
  'a PATCH from allow to forbid while a run is in flight: a run triggered next is skipped, not run beside it',
  { timeout: 60_000 },
  async () => {
    const jobId = await triggeredJob('/patch-forbid/slow', { retry: { maxAttempts: 1, backoffMs: 100 } });
    const first = await trigger(jobId);
    await waitFor('the first call in flight', () => callsOf(first).length === 1);
    await call('PATCH', `/jobs/${jobId}`, { concurrency: 'forbid' });
    const second = await trigger(jobId);
    const decided = await waitFor('the second run decided', async () => {
      const run = await runOf(jobId, second);
      return run && run.state !== 'queued' ? run : null;
    });
    const overlapping = callsOf(second).filter((c) => c.arrivedAt < (callsOf(first)[0]!.endedAt ?? Infinity));
    assert.deepEqual(
      [decided.state, decided.reason, overlapping.length],
      ['skipped', 'concurrency-forbid', 0],
      'the job is forbid now: its next run must not run while the first is active',
    );
  },
);

/** helios_stale_completions_total of the node (calls whose outcome was discarded: HeliosCallsNotRecorded). */
async function staleCompletions(): Promise<number> {
  const response = await fetch(`${api}/metrics`);
  assert.equal(response.status, 200);
  return parseMetrics(await response.text()).sum('helios_stale_completions_total');
}

test(
  'a call aborted because its run was replaced or its job deleted is not counted as an outcome discarded for a run called again',
  { timeout: 60_000 },
  async () => {
    const before = await staleCompletions();
    // replace: a newer run's start aborts the older run's call; the older run is not called again.
    const replaceJob = await triggeredJob('/stale-replace/hang', {
      concurrency: 'replace',
      timeoutMs: 20_000,
      retry: { maxAttempts: 1, backoffMs: 100 },
    });
    const older = await trigger(replaceJob);
    await waitFor('the older call in flight', () => callsOf(older).length === 1);
    await trigger(replaceJob);
    await waitFor('the older call aborted', () => callsOf(older)[0]?.aborted);
    // delete: the job's run goes with it, and its call is aborted.
    const deletedJob = await triggeredJob('/stale-delete/hang', {
      timeoutMs: 20_000,
      retry: { maxAttempts: 1, backoffMs: 100 },
    });
    const gone = await trigger(deletedJob);
    await waitFor('the call in flight', () => callsOf(gone).length === 1);
    const response = await fetch(`${api}/api/v1/jobs/${deletedJob}`, {
      method: 'DELETE',
      headers: { 'content-type': 'application/json' },
      body: '{}',
    });
    assert.equal(response.status, 204);
    await waitFor('the call of the deleted job aborted', () => callsOf(gone)[0]?.aborted);
    await sleep(500); // the workers' bookkeeping after the aborts
    assert.equal(
      (await staleCompletions()) - before,
      0,
      'HeliosCallsNotRecorded would say these runs are called again; neither is',
    );
    await call('POST', `/jobs/${replaceJob}/pause`);
  },
);

test(
  "a pause while an occurrence's call is in flight, the call then failing: its retry still runs",
  { timeout: 60_000 },
  async () => {
    const at = await nextWholeSecond(fx.db.pool, 1500);
    const job = await call('POST', '/jobs', {
      name: `pause-in-flight-${uniqueId()}`,
      schedule: oncePerMinuteAt(at),
      target: { url: `${fx.target.url}/pause-in-flight/slow-once` },
      timeoutMs: 5000,
      retry: { maxAttempts: 2, backoffMs: 500, backoffMultiplier: 1 },
    });
    const inFlight = await waitFor('the call in flight', () =>
      fx.target.requests.find((r) => r.jobId === job.id && r.endedAt === undefined),
    );
    await call('POST', `/jobs/${job.id}/pause`);
    await waitFor(
      'the retry to succeed',
      async () => (await runOf(job.id, inFlight.runId))?.state === 'succeeded',
      10_000,
    );
    assert.deepEqual(
      callsOf(inFlight.runId).map((c) => [c.attempt, c.status]),
      [
        [1, 500],
        [2, 200],
      ],
    );
  },
);
