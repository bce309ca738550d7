import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { attemptsOf, runsOf, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { apiCall } from '../support/node-api.js';

// README Guarantees, "What users do keeps that promise": every occurrence that fell due while the
// job was enabled has exactly one run that executes; a pause withdraws the runs of later
// occurrences whose call has not begun. A worker marks a run it claimed ahead started when the run
// is due, and only then waits for an execution slot (start passes, run-queue.ts; runAttempt's
// untilSlot): such a run is past the pause's line though its call has not begun. Here the node's
// only slot is held by a call the test keeps open, two occurrences of an every-second job fall due
// and are marked started while they wait behind it, the job is paused after their due instants,
// and only then does the slow call end: both are called once and recorded, and the occurrence the
// worker had claimed ahead of its time, due after the pause, is withdrawn and never called.
// Real PostgreSQL, Kafka and etcd; one real node.

// A lead of 3 s, as operations-claims.test.ts: the runs of the next seconds are claimed before the
// first of them waits for the slot (once runs wait, the node claims ahead only at the pace its
// slots are given, here none).
const CLAIM_LEAD_MS = 3000;
// The claim watch looks at the waiting runs every 200 ms: it has looked several times while the
// job was paused before the slot frees (a watch that took a paused job's runs as lost would act).
const CLAIM_CHECK_MS = 200;

let fixture: IntegrationFixture;
let api: string;
/** Lets the blocker's call end (the target answers it then). */
let endBlockerCall: () => void;
const blockerCallEnds = new Promise<void>((resolve) => {
  endBlockerCall = resolve;
});

interface JobAnswer {
  id: string;
  enabled: boolean;
  updatedAt: string;
}

const call = <T>(method: string, path: string, body?: unknown) => apiCall<T>(api, method, path, body);

before(async () => {
  fixture = await integrationFixture({
    behaviour: (request) =>
      request.path === '/blocker' ? { status: 200, until: blockerCallEnds } : { status: 200 },
  });
  const started = await fixture.start('one-slot', {
    HELIOS_WORKER_CONCURRENCY: '1',
    HELIOS_CLAIM_LEAD_MS: String(CLAIM_LEAD_MS),
    HELIOS_CLOCK_SKEW_TOLERANCE_MS: '10',
    HELIOS_CLAIM_CHECK_INTERVAL_MS: String(CLAIM_CHECK_MS),
  });
  api = started.apiUrl;
});
after(async () => {
  endBlockerCall();
  await fixture.teardown();
});

/** The job's runs as PostgreSQL has them now; `due`: scheduled_for has passed by its clock. */
async function runsNow(jobId: string) {
  const { rows } = await fixture.db.pool.query<{
    id: string;
    scheduledFor: Date;
    state: string;
    startedAt: Date | null;
    claimedBy: string | null;
    due: boolean;
  }>(
    `SELECT id, scheduled_for AS "scheduledFor", state, started_at AS "startedAt", claimed_by AS "claimedBy",
            scheduled_for <= now() AS due
     FROM runs WHERE job_id = $1 ORDER BY scheduled_for`,
    [jobId],
  );
  return rows;
}

test(
  'a pause after runs were marked started while they wait for a slot: each is called once, recorded; the run claimed ahead for after the pause is not called',
  { timeout: 30_000 },
  async () => {
    // The slow call: a manual run of a job of its own, holding the node's one slot until released.
    const blocker = await call<JobAnswer>('POST', '/jobs', {
      name: `blocker-${uniqueId()}`,
      schedule: '0 0 1 1 *', // never during the test: only the manual run
      target: { url: `${fixture.target.url}/blocker`, method: 'POST' },
      timeoutMs: 30_000,
      retry: { maxAttempts: 1, backoffMs: 100 },
    });
    const { runId: blockerRun } = await call<{ runId: string }>('POST', `/jobs/${blocker.id}/trigger`);
    await waitFor('the blocker’s call to reach the target', () =>
      fixture.target.requests.some((r) => r.runId === blockerRun),
    );

    const job = await call<JobAnswer>('POST', '/jobs', {
      name: `paused-behind-slot-${uniqueId()}`,
      schedule: '* * * * * *',
      target: { url: `${fixture.target.url}/paused`, method: 'POST' },
      timeoutMs: 5000,
      retry: { maxAttempts: 1, backoffMs: 100 },
    });
    // Two occurrences due and marked started by the worker, neither called: they wait for the slot.
    const waiting = await waitFor(
      'two runs marked started while the slot is held',
      async () => {
        const runs = await runsNow(job.id);
        const started = runs.filter((r) => r.startedAt !== null);
        return started.length >= 2 ? runs : null;
      },
      15_000,
      20,
    );
    const startedBefore = waiting.filter((r) => r.startedAt !== null);
    const claimedAhead = waiting.filter((r) => r.startedAt === null && r.state === 'running' && !r.due);
    // The state the test is about, as PostgreSQL has it just before the pause.
    assert.deepEqual(
      startedBefore.map((r) => [r.state, r.due, r.claimedBy !== null]),
      startedBefore.map(() => ['running', true, true]),
      'the started runs are due, running and claimed',
    );
    assert.ok(claimedAhead.length > 0, 'the worker also holds a run claimed ahead of its time');
    assert.deepEqual(
      fixture.target.forJob(job.id).map((c) => c.scheduledFor),
      [],
      'no run of the job has been called yet: the slot is held',
    );
    assert.equal(
      fixture.target.requests.find((r) => r.runId === blockerRun)?.endedAt,
      undefined,
      'the blocker’s call is still open',
    );

    // The pause, after the started runs' due instants.
    const response = await fetch(`${api}/api/v1/jobs/${job.id}/pause`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: '{}',
    });
    const pauseText = await response.text();
    assert.equal(response.status, 200, `pause: ${pauseText}`);
    const paused = JSON.parse(pauseText) as JobAnswer;
    assert.equal(paused.id, job.id);
    assert.equal(paused.enabled, false, 'the pause answers the job disabled');
    assert.equal((await call<JobAnswer>('GET', `/jobs/${job.id}`)).enabled, false);
    const pausedAt = Date.parse(paused.updatedAt);
    for (const run of startedBefore) {
      assert.ok(
        run.scheduledFor.getTime() < pausedAt,
        `${run.scheduledFor.toISOString()} was due before the pause at ${paused.updatedAt}`,
      );
    }
    const afterPause = await runsNow(job.id);
    assert.deepEqual(
      afterPause.filter((r) => r.scheduledFor.getTime() > pausedAt).map((r) => r.scheduledFor.toISOString()),
      [],
      'the runs due after the pause were withdrawn, the one claimed ahead among them',
    );
    assert.deepEqual(
      afterPause.filter((r) => startedBefore.some((s) => s.id === r.id)).map((r) => [r.id, r.state]),
      startedBefore.map((r) => [r.id, 'running']),
      'the pause left the started runs as they were',
    );

    // The slow call ends a while after the pause, past a few of the claim watch's looks.
    await sleep(3 * CLAIM_CHECK_MS + 100);
    assert.deepEqual(
      fixture.target.forJob(job.id).map((c) => c.scheduledFor),
      [],
      'still nothing called while the slot was held',
    );
    endBlockerCall();

    // Every occurrence due before the pause (the started ones among them) ran once and succeeded.
    const dueBefore = afterPause.filter((r) => r.scheduledFor.getTime() <= pausedAt);
    const settled = await waitFor(
      'the runs due before the pause to end',
      async () => {
        const runs = (await runsOf(fixture.db.pool, job.id)).filter((r) =>
          dueBefore.some((d) => d.id === r.id),
        );
        return runs.length === dueBefore.length && runs.every((r) => !['queued', 'running'].includes(r.state))
          ? runs
          : null;
      },
      // A few calls and their writes; well before the reaper would recover a run whose claim a
      // worker dropped (its claim expires 5 s + the timeout after it was due).
      6000,
    );
    const problems: string[] = [];
    for (const run of settled) {
      const at = run.scheduledFor.toISOString();
      const calls = fixture.target.requests.filter((r) => r.runId === run.id);
      if (run.state !== 'succeeded') problems.push(`${at}: ${run.state} (${run.reason})`);
      if (calls.length !== 1) problems.push(`${at}: ${calls.length} calls`);
      const attempts = await attemptsOf(fixture.db.pool, run.id);
      if (attempts.length !== 1 || attempts[0]!.outcome !== 'succeeded' || attempts[0]!.statusCode !== 200)
        problems.push(`${at}: attempts ${JSON.stringify(attempts.map((a) => [a.outcome, a.statusCode]))}`);
    }
    assert.deepEqual(problems, [], 'each occurrence due before the pause: one call, recorded succeeded');
    for (const run of startedBefore) {
      assert.ok(
        settled.some((s) => s.id === run.id),
        `the run marked started for ${run.scheduledFor.toISOString()} was one of them`,
      );
    }
    // Each whole second from the first occurrence up to the pause has its run: none was lost.
    const first = Math.min(...dueBefore.map((r) => r.scheduledFor.getTime()));
    const seconds = Math.floor((pausedAt - first) / 1000) + 1;
    assert.deepEqual(
      settled.map((r) => r.scheduledFor.getTime()),
      Array.from({ length: seconds }, (_, i) => first + i * 1000),
      'every occurrence before the pause has a run',
    );

    // Past the time of the last run claimed ahead: no call for an occurrence after the pause.
    await sleep(Math.max(0, claimedAhead.at(-1)!.scheduledFor.getTime() + 500 - Date.now()));
    assert.deepEqual(
      fixture.target
        .forJob(job.id)
        .filter((c) => Date.parse(c.scheduledFor) > pausedAt)
        .map((c) => c.scheduledFor),
      [],
      'no call for an occurrence after the pause',
    );
    assert.deepEqual(
      (await runsNow(job.id)).filter((r) => r.scheduledFor.getTime() > pausedAt).map((r) => r.id),
      [],
      'and no run of one',
    );
    const blockerRuns = await runsOf(fixture.db.pool, blocker.id);
    assert.deepEqual(
      blockerRuns.map((r) => r.state),
      ['succeeded'],
      'the slow call was recorded too',
    );
  },
);
