import { setTimeout as sleep } from 'node:timers/promises';
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { waitFor, type TargetRequest } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { apiCall } from '../support/node-api.js';

// Two statements of the README's guarantee list ("What users do keeps that promise"):
// - a pause or an edit withdraws an occurrence a worker claimed ahead of its time (an `allow` run
//   is claimed up to HELIOS_CLAIM_LEAD_MS + HELIOS_CLOCK_SKEW_TOLERANCE_MS before it is due) as
//   long as its call has not begun: the occurrence follows the job as it is when it falls due;
// - a manual trigger makes one run, which `forbid` skips (reason `concurrency-forbid`) while
//   another run of the job is active, and runs once none is.

// A lead of 3 s instead of the default: the same code path, with a window wide enough to land a
// pause in it for certain on a busy machine.
const CLAIM_LEAD_MS = 3000;
const SKEW_TOLERANCE_MS = 10;
/** A call may start this much before its time by our clock (timer and clock-estimate rounding). */
const EARLY_TOLERANCE_MS = 25;

/** Jobs whose first call is answered after 3 s (a run that stays active). */
const slowFirstCall = new Set<string>();

let fixture: IntegrationFixture;
let api: string;

interface JobAnswer {
  id: string;
  updatedAt: string;
}
interface RunAnswer {
  id: string;
  state: string;
  reason: string | null;
  trigger: string;
  scheduledFor: string;
}

const call = <T>(method: string, path: string, body?: unknown) => apiCall<T>(api, method, path, body);

before(async () => {
  fixture = await integrationFixture({
    behaviour: (request, nth) =>
      slowFirstCall.has(request.jobId) && nth === 1 && fixture.target.forJob(request.jobId).length === 1
        ? { status: 200, delayMs: 3000 }
        : { status: 200 },
  });
  const started = await fixture.start('claims-1', {
    HELIOS_CLAIM_LEAD_MS: String(CLAIM_LEAD_MS),
    HELIOS_CLOCK_SKEW_TOLERANCE_MS: String(SKEW_TOLERANCE_MS),
  });
  api = started.apiUrl;
});
after(async () => {
  await fixture.teardown();
});

/** Runs of `jobId` claimed ahead of their time right now (running, due later than `aheadMs`). */
async function claimedAhead(jobId: string, aheadMs: number) {
  const { rows } = await fixture.db.pool.query<{ id: string; scheduledFor: Date }>(
    `SELECT id, scheduled_for AS "scheduledFor" FROM runs
     WHERE job_id = $1 AND state = 'running' AND not_before > now() + $2 * interval '1 millisecond'
     ORDER BY scheduled_for`,
    [jobId, aheadMs],
  );
  return rows;
}

/**
 * Waits until a run of the every-second job `jobId` is claimed and due more than 1.5 s later; on
 * every look, also checks that no run was claimed earlier than the lead allows.
 */
async function untilClaimedAhead(jobId: string) {
  return waitFor(
    'a run claimed ahead of its time',
    async () => {
      const tooEarly = await claimedAhead(jobId, CLAIM_LEAD_MS + SKEW_TOLERANCE_MS);
      assert.deepEqual(tooEarly, [], 'no run is claimed more than lead + skew tolerance before it is due');
      const ahead = await claimedAhead(jobId, 1500);
      return ahead.length > 0 ? ahead : null;
    },
    20_000,
  );
}

/**
 * Waits until every run of `jobId` due after `after` has ended, then checks each: succeeded, one
 * call, not before its time, at `path`. Returns them.
 */
async function checkRunsAfter(jobId: string, after: number, path: string) {
  const { rows } = await fixture.db.pool.query<{ id: string; state: string; scheduledFor: Date }>(
    `SELECT id, state, scheduled_for AS "scheduledFor" FROM runs
     WHERE job_id = $1 AND scheduled_for > $2 ORDER BY scheduled_for`,
    [jobId, new Date(after)],
  );
  const settled = await waitFor(
    'the runs due after the change to end',
    async () => {
      const runs = await Promise.all(rows.map((r) => call<RunAnswer>('GET', `/runs/${r.id}`)));
      return runs.every((r) => !['queued', 'running'].includes(r.state)) ? runs : null;
    },
    20_000,
  );
  const problems: string[] = [];
  for (const run of settled) {
    const calls: TargetRequest[] = fixture.target.requests.filter((r) => r.runId === run.id);
    const due = Date.parse(run.scheduledFor);
    if (run.state !== 'succeeded') problems.push(`${run.scheduledFor}: ${run.state} (${run.reason})`);
    if (calls.length !== 1) problems.push(`${run.scheduledFor}: ${calls.length} calls`);
    for (const c of calls) {
      if (c.arrivedAt < due - EARLY_TOLERANCE_MS)
        problems.push(`${run.scheduledFor}: called ${(due - c.arrivedAt).toFixed(0)} ms early`);
      if (c.path !== path) problems.push(`${run.scheduledFor}: called at ${c.path}, not ${path}`);
    }
  }
  assert.deepEqual(
    problems,
    [],
    'every run due after the change ran once, at its time, on the target in force',
  );
  // Nothing else of the job was called for an occurrence after the change: only these runs.
  const ids = new Set(settled.map((r) => r.id));
  const others = fixture.target
    .forJob(jobId)
    .filter((c) => Date.parse(c.scheduledFor) > after && !ids.has(c.runId) && c.path === path);
  assert.deepEqual(
    others.map((c) => c.scheduledFor),
    [],
    'no other call of the old definition',
  );
  return settled;
}

test(
  'a pause withdraws an occurrence claimed ahead of its time: its call is never made',
  { timeout: 60_000 },
  async () => {
    const job = await call<JobAnswer>('POST', '/jobs', {
      name: `claimed-pause-${uniqueId()}`,
      schedule: '* * * * * *',
      target: { url: `${fixture.target.url}/claimed-pause`, method: 'POST' },
    });
    const claimed = await untilClaimedAhead(job.id);
    const paused = await call<JobAnswer>('POST', `/jobs/${job.id}/pause`);
    const pausedAt = Date.parse(paused.updatedAt);
    const ahead = claimed.filter((r) => r.scheduledFor.getTime() > pausedAt);
    // The pause really landed while runs were claimed and not yet due.
    assert.ok(ahead.length > 0, `no claimed run was due after the pause at ${paused.updatedAt}`);
    // Past the last one's time, with room for a late call.
    await sleep(Math.max(0, ahead.at(-1)!.scheduledFor.getTime() + 1500 - Date.now()));
    const { rows } = await fixture.db.pool.query<{ id: string }>(
      'SELECT id FROM runs WHERE id = ANY($1::uuid[])',
      [ahead.map((r) => r.id)],
    );
    assert.deepEqual(rows, [], 'the runs claimed ahead were withdrawn');
    const after = fixture.target.forJob(job.id).filter((c) => Date.parse(c.scheduledFor) > pausedAt);
    assert.deepEqual(
      after.map((c) => c.scheduledFor),
      [],
      'no call for an occurrence after the pause',
    );
  },
);

test(
  'an edit of its target withdraws an occurrence claimed ahead of its time: it runs once, on the new target',
  { timeout: 60_000 },
  async () => {
    const job = await call<JobAnswer>('POST', '/jobs', {
      name: `claimed-patch-${uniqueId()}`,
      schedule: '* * * * * *',
      target: { url: `${fixture.target.url}/claimed-patch/old`, method: 'POST' },
    });
    const claimed = await untilClaimedAhead(job.id);
    const edited = await call<JobAnswer>('PATCH', `/jobs/${job.id}`, {
      target: { url: `${fixture.target.url}/claimed-patch/new`, method: 'POST' },
    });
    const editedAt = Date.parse(edited.updatedAt);
    const ahead = claimed.filter((r) => r.scheduledFor.getTime() > editedAt);
    assert.ok(ahead.length > 0, 'the edit landed before a claimed run was due');
    const { rows } = await fixture.db.pool.query<{ id: string }>(
      'SELECT id FROM runs WHERE id = ANY($1::uuid[])',
      [ahead.map((r) => r.id)],
    );
    assert.deepEqual(rows, [], 'the edit withdrew the runs claimed ahead');
    // Past the last withdrawn occurrence's time, then stop the job so the runs to check are bounded.
    await sleep(Math.max(0, ahead.at(-1)!.scheduledFor.getTime() + 1500 - Date.now()));
    await call('POST', `/jobs/${job.id}/pause`);
    const settled = await checkRunsAfter(job.id, editedAt, '/claimed-patch/new');
    const instants = new Set(settled.map((r) => Date.parse(r.scheduledFor)));
    for (const run of ahead) {
      assert.ok(
        instants.has(run.scheduledFor.getTime()),
        `the occurrence due ${run.scheduledFor.toISOString()} ran, from the new definition`,
      );
    }
    const old = fixture.target
      .forJob(job.id)
      .filter((c) => Date.parse(c.scheduledFor) > editedAt && c.path === '/claimed-patch/old');
    assert.deepEqual(
      old.map((c) => c.scheduledFor),
      [],
      'no call on the old target for an occurrence after the edit',
    );
  },
);

test(
  'forbid: a manual trigger while another run is active makes one run, skipped; once none is, it runs',
  { timeout: 60_000 },
  async () => {
    const job = await call<JobAnswer>('POST', '/jobs', {
      name: `forbid-trigger-${uniqueId()}`,
      schedule: '0 0 1 1 *', // never during the test: only manual runs
      target: { url: `${fixture.target.url}/forbid-trigger`, method: 'POST' },
      concurrency: 'forbid',
      retry: { maxAttempts: 1, backoffMs: 100 },
    });
    slowFirstCall.add(job.id);
    const active = await call<{ runId: string }>('POST', `/jobs/${job.id}/trigger`);
    await waitFor('the first run to reach the target', () =>
      fixture.target.requests.some((r) => r.runId === active.runId),
    );

    // The API answers 202 with the run it created; the run is skipped when a worker takes it.
    const response = await fetch(`${api}/api/v1/jobs/${job.id}/trigger`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: '{}',
    });
    assert.equal(response.status, 202);
    const second = (await response.json()) as { runId: string };
    assert.ok(second.runId && second.runId !== active.runId, 'the trigger created a run of its own');
    const skipped = await waitFor(
      'the second run to end',
      async () => {
        const run = await call<RunAnswer>('GET', `/runs/${second.runId}`);
        return ['queued', 'running'].includes(run.state) ? null : run;
      },
      20_000,
    );
    assert.equal(skipped.state, 'skipped', `the trigger's run ended ${skipped.state} (${skipped.reason})`);
    assert.equal(skipped.reason, 'concurrency-forbid');
    assert.equal(skipped.trigger, 'manual');
    const first = await call<RunAnswer>('GET', `/runs/${active.runId}`);
    assert.ok(['running', 'succeeded'].includes(first.state), `the active run is ${first.state}`);

    await waitFor(
      'the first run to succeed',
      async () => (await call<RunAnswer>('GET', `/runs/${active.runId}`)).state === 'succeeded',
    );
    // No run of the job is active now: a trigger runs.
    const third = await call<{ runId: string }>('POST', `/jobs/${job.id}/trigger`);
    await waitFor(
      'the third run to succeed',
      async () => (await call<RunAnswer>('GET', `/runs/${third.runId}`)).state === 'succeeded',
    );
    assert.equal(
      fixture.target.requests.filter((r) => r.runId === second.runId).length,
      0,
      'the skipped run was never called',
    );
    const { rows } = await fixture.db.pool.query<{ id: string }>('SELECT id FROM runs WHERE job_id = $1', [
      job.id,
    ]);
    assert.deepEqual(
      rows.map((r) => r.id).sort(),
      [active.runId, second.runId, third.runId].sort(),
      'each trigger made exactly one run',
    );
  },
);
