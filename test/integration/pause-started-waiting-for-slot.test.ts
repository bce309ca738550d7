import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, describe, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { attemptsOf, runsOf, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { apiCall } from '../support/node-api.js';

// README Guarantees, "What users do keeps that promise": every occurrence that fell due while the
// job was enabled has exactly one run that executes; a pause withdraws the runs of later
// occurrences whose call has not begun. A worker marks a run it claimed ahead started when the run
// is due, and only then waits for an execution slot (start passes, run-queue.ts; runAttempt's
// untilSlot): such a run is past the pause's line though its call has not begun. Here a node's
// only slot is held by a call the test keeps open, two occurrences of an every-second job fall due
// and are marked started while they wait behind it, the job is paused after their due instants,
// and only then does the slow call end: both are called once and recorded, and the occurrences the
// worker had claimed ahead of their time, due after the pause, are withdrawn and never called.
// Twice, on two nodes at once (each with its own database, topic and target): the slot frees
// within the claim grace, and the slot frees past it, so that each waiting run is handed back
// uncalled (`claim-too-late`), re-queued while its job is paused, claimed again and called.
// Real PostgreSQL, Kafka and etcd; real nodes.

// A lead of 3 s, as operations-claims.test.ts: the runs of the next seconds are claimed before the
// first of them waits for the slot (once runs wait, a node claims ahead only at the pace its slots
// are given, here none).
const CLAIM_LEAD_MS = 3000;
// The claim watch looks at the waiting runs every 200 ms: it has looked several times while the
// job was paused before the slot frees (a watch that took a paused job's runs as lost would act).
const CLAIM_CHECK_MS = 200;
/** The every-second job's call timeout: its claims expire this + the grace after they were due. */
const TIMEOUT_MS = 5000;

interface JobAnswer {
  id: string;
  enabled: boolean;
  updatedAt: string;
}

/** A node with one execution slot, and the means to hold that slot with a call. */
interface OneSlotNode {
  fixture: IntegrationFixture;
  api: string;
  /** Lets the blocker's call end (the target answers it then). */
  endBlockerCall: () => void;
}

async function oneSlotNode(name: string, claimGraceMs: number): Promise<OneSlotNode> {
  let endBlockerCall!: () => void;
  const blockerCallEnds = new Promise<void>((resolve) => {
    endBlockerCall = resolve;
  });
  const fixture = await integrationFixture({
    behaviour: (request) =>
      request.path === '/blocker' ? { status: 200, until: blockerCallEnds } : { status: 200 },
  });
  try {
    const started = await fixture.start(name, {
      HELIOS_WORKER_CONCURRENCY: '1',
      HELIOS_CLAIM_LEAD_MS: String(CLAIM_LEAD_MS),
      HELIOS_CLAIM_GRACE_MS: String(claimGraceMs),
      HELIOS_CLOCK_SKEW_TOLERANCE_MS: '10',
      HELIOS_CLAIM_CHECK_INTERVAL_MS: String(CLAIM_CHECK_MS),
    });
    return { fixture, api: started.apiUrl, endBlockerCall };
  } catch (err) {
    await fixture.teardown();
    throw err;
  }
}

// The default grace (5 s): the slot frees well within it. 1 s: the runs wait past it.
let withinGrace: OneSlotNode;
let pastGrace: OneSlotNode;

before(async () => {
  [withinGrace, pastGrace] = await Promise.all([
    oneSlotNode('one-slot-grace-5s', 5000),
    oneSlotNode('one-slot-grace-1s', 1000),
  ]);
});
after(async () => {
  const nodes = [withinGrace, pastGrace].filter((n) => n !== undefined);
  for (const node of nodes) node.endBlockerCall();
  await Promise.all(nodes.map((n) => n.fixture.teardown()));
});

/** The job's runs as PostgreSQL has them now; `due`: scheduled_for has passed by its clock. */
async function runsNow(fixture: IntegrationFixture, jobId: string) {
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

/**
 * The scenario on `node`: the slot held, two runs marked started behind it, the pause, the slot
 * freed `slotFreedAfterMs` after the pause. Checks what the header says; returns the attempts of
 * the runs due before the pause, oldest first, for the caller's own checks.
 */
async function pauseWhileStartedRunsWait(node: OneSlotNode, slotFreedAfterMs: number) {
  const { fixture, api } = node;
  const call = <T>(method: string, path: string, body?: unknown) => apiCall<T>(api, method, path, body);
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
    timeoutMs: TIMEOUT_MS,
    retry: { maxAttempts: 1, backoffMs: 100 },
  });
  // Two occurrences due and marked started by the worker, neither called: they wait for the slot.
  // Due by the database clock: a worker marks a run started up to the skew tolerance early.
  const waiting = await waitFor(
    'two runs marked started and due while the slot is held',
    async () => {
      const runs = await runsNow(fixture, job.id);
      return runs.filter((r) => r.startedAt !== null && r.due).length >= 2 ? runs : null;
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
  const afterPause = await runsNow(fixture, job.id);
  assert.deepEqual(
    afterPause.filter((r) => r.scheduledFor.getTime() > pausedAt).map((r) => r.scheduledFor.toISOString()),
    [],
    'the runs due after the pause were withdrawn, those claimed ahead among them',
  );
  assert.deepEqual(
    afterPause.filter((r) => startedBefore.some((s) => s.id === r.id)).map((r) => [r.id, r.state]),
    startedBefore.map((r) => [r.id, 'running']),
    'the pause left the started runs as they were',
  );

  // The slow call ends a while after the pause, past a few of the claim watch's looks.
  await sleep(slotFreedAfterMs);
  assert.deepEqual(
    fixture.target.forJob(job.id).map((c) => c.scheduledFor),
    [],
    'still nothing called while the slot was held',
  );
  node.endBlockerCall();

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
    // worker dropped (its claim expires the timeout + the grace after it was due).
    6000,
  );
  const problems: string[] = [];
  const attempts = new Map<string, Awaited<ReturnType<typeof attemptsOf>>>();
  for (const run of settled) {
    const at = run.scheduledFor.toISOString();
    const calls = fixture.target.requests.filter((r) => r.runId === run.id);
    if (run.state !== 'succeeded') problems.push(`${at}: ${run.state} (${run.reason})`);
    if (calls.length !== 1) problems.push(`${at}: ${calls.length} calls`);
    const ofRun = await attemptsOf(fixture.db.pool, run.id);
    attempts.set(run.id, ofRun);
    const last = ofRun.at(-1);
    if (last?.outcome !== 'succeeded' || last.statusCode !== 200 || calls[0]?.attempt !== last.attempt)
      problems.push(
        `${at}: attempts ${JSON.stringify(ofRun.map((a) => [a.attempt, a.outcome, a.statusCode]))}`,
      );
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
    (await runsNow(fixture, job.id)).filter((r) => r.scheduledFor.getTime() > pausedAt).map((r) => r.id),
    [],
    'and no run of one',
  );
  const blockerRuns = await runsOf(fixture.db.pool, blocker.id);
  assert.deepEqual(
    blockerRuns.map((r) => r.state),
    ['succeeded'],
    'the slow call was recorded too',
  );
  return startedBefore.map((r) => attempts.get(r.id)!);
}

describe('a pause after runs were marked started while they wait for a slot', { concurrency: true }, () => {
  test(
    'the slot frees within the claim grace: each is called once, recorded; the runs claimed ahead for after the pause are not called',
    { timeout: 30_000 },
    async () => {
      const attempts = await pauseWhileStartedRunsWait(withinGrace, 3 * CLAIM_CHECK_MS + 100);
      assert.deepEqual(
        attempts.map((a) => a.map((x) => x.outcome)),
        attempts.map(() => ['succeeded']),
        'each started run was called on the claim it waited with',
      );
    },
  );

  test(
    'the slot frees past the claim grace: each is handed back uncalled, claimed again while paused, called once, recorded',
    { timeout: 30_000 },
    async () => {
      // Past the 1 s grace for both runs, within their claims (due + timeout + grace): the worker
      // hands them back when they get the slot, not the reaper when their claims expire.
      const attempts = await pauseWhileStartedRunsWait(pastGrace, 2500);
      for (const ofRun of attempts) {
        const before = ofRun.slice(0, -1);
        assert.ok(before.length > 0, 'the run was handed back before its call');
        assert.deepEqual(
          before.map((a) => [a.outcome, /less than the timeout; call not made/.test(a.error ?? '')]),
          before.map(() => ['cancelled', true]),
          'handed back uncalled (claim-too-late), at no cost: the claim in force when it was called is its last',
        );
      }
    },
  );
});
