import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { createTestDatabase } from '../support/database.js';
import { uniqueId } from '../support/env.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { apiCall, startNode } from '../support/node-api.js';

// What users do to a job while it runs (pause, resume, PATCH) must leave every occurrence that
// fell due while the job was enabled with exactly one run that executes (contract item 10).

let fx: IntegrationFixture;
let leaderApi: string;
let workerApi: string;

interface JobAnswer {
  id: string;
  enabled: boolean;
  updatedAt: string;
  createdAt: string;
  nextRunAt: string | null;
}

const call = (api: string, method: string, path: string, body?: unknown) =>
  apiCall<JobAnswer>(api, method, path, body);

before(async () => {
  fx = await integrationFixture();
  // A leader with every role; the last test adds a worker/api node without the scheduler role: a
  // job created on a database that no leader dispatches stands for a dispatcher that lags.
  leaderApi = (await fx.start('ops-leader')).apiUrl;
});
after(() => fx.teardown());

/** Intervals in which a job was enabled, from the API's own answers (database time). */
type Interval = { from: number; to: number };

/**
 * Checks every whole second in [start, end] of an every-second job against the intervals in
 * which it was enabled: inside one (by more than `marginMs`) exactly one run, succeeded, and
 * exactly one call at the target; outside all of them (by more than `marginMs`) no call.
 */
async function checkOccurrences(jobId: string, enabled: Interval[], start: number, end: number) {
  const marginMs = 150;
  const { rows } = await fx.db.pool.query<{ id: string; state: string; at: Date }>(
    `SELECT id, state, scheduled_for AS at FROM runs WHERE job_id = $1 AND trigger = 'schedule'`,
    [jobId],
  );
  const runs = new Map(rows.map((r) => [r.at.getTime(), r]));
  const calls = fx.target.forJob(jobId);
  const problems: string[] = [];
  let due = 0;
  for (let s = Math.ceil(start / 1000) * 1000; s <= end; s += 1000) {
    const inside = enabled.some((i) => s > i.from + marginMs && s < i.to - marginMs);
    const outside = enabled.every((i) => s < i.from - marginMs || s > i.to + marginMs);
    const run = runs.get(s);
    const arrived = calls.filter((c) => Date.parse(c.scheduledFor) === s);
    const at = new Date(s).toISOString();
    if (inside) {
      due += 1;
      if (!run) problems.push(`${at}: due while enabled, no run`);
      else if (run.state !== 'succeeded') problems.push(`${at}: due while enabled, run ${run.state}`);
      if (arrived.length !== 1) problems.push(`${at}: due while enabled, ${arrived.length} calls`);
    } else if (outside && arrived.length > 0) {
      problems.push(`${at}: due while paused, ${arrived.length} calls`);
    }
  }
  assert.ok(due > 0, 'the window holds occurrences due while enabled');
  assert.deepEqual(problems, [], `${problems.length} of the ${due} occurrences due while enabled went wrong`);
}

test(
  'pause then resume inside the dispatch lookahead: every occurrence due while enabled runs once',
  { timeout: 60_000 },
  async () => {
    const created = await call(leaderApi, 'POST', '/jobs', {
      name: `pause-resume-${uniqueId()}`,
      schedule: '* * * * * *',
      target: { url: `${fx.target.url}/pause-resume`, method: 'POST' },
      timeoutMs: 5000,
    });
    const enabled: Interval[] = [];
    let from = Date.parse(created.createdAt);
    await sleep(2200);
    for (let i = 0; i < 3; i++) {
      const paused = await call(leaderApi, 'POST', `/jobs/${created.id}/pause`);
      assert.equal(paused.enabled, false);
      enabled.push({ from, to: Date.parse(paused.updatedAt) });
      await sleep(300);
      const resumed = await call(leaderApi, 'POST', `/jobs/${created.id}/resume`);
      assert.equal(resumed.enabled, true);
      from = Date.parse(resumed.updatedAt);
      await sleep(2000);
    }
    const last = await call(leaderApi, 'POST', `/jobs/${created.id}/pause`);
    enabled.push({ from, to: Date.parse(last.updatedAt) });
    await sleep(1500); // the last calls finish
    await checkOccurrences(created.id, enabled, Date.parse(created.createdAt), Date.parse(last.updatedAt));
  },
);

test(
  'PATCH of enabled, target and schedule inside the lookahead: each occurrence runs once, as defined when due',
  { timeout: 60_000 },
  async () => {
    const created = await call(leaderApi, 'POST', '/jobs', {
      name: `patch-${uniqueId()}`,
      schedule: '* * * * * *',
      target: { url: `${fx.target.url}/patch/v0`, method: 'POST' },
    });
    const enabled: Interval[] = [];
    let from = Date.parse(created.createdAt);
    // Which path each occurrence must have been called on: [from, path] changes in order.
    const paths: { from: number; path: string }[] = [{ from, path: '/patch/v0' }];
    await sleep(1700);
    for (let i = 1; i <= 2; i++) {
      const edited = await call(leaderApi, 'PATCH', `/jobs/${created.id}`, {
        target: { url: `${fx.target.url}/patch/v${i}`, method: 'POST' },
      });
      paths.push({ from: Date.parse(edited.updatedAt), path: `/patch/v${i}` });
      await sleep(1300);
      const off = await call(leaderApi, 'PATCH', `/jobs/${created.id}`, { enabled: false });
      enabled.push({ from, to: Date.parse(off.updatedAt) });
      await sleep(250);
      const on = await call(leaderApi, 'PATCH', `/jobs/${created.id}`, {
        enabled: true,
        // The same instants, written differently: a new schedule whose occurrences collide with
        // the old ones must not be blocked by what the old one left behind.
        schedule: i === 1 ? '*/1 * * * * *' : '* * * * * *',
      });
      from = Date.parse(on.updatedAt);
      await sleep(1700);
    }
    const last = await call(leaderApi, 'POST', `/jobs/${created.id}/pause`);
    enabled.push({ from, to: Date.parse(last.updatedAt) });
    await sleep(1500);
    await checkOccurrences(created.id, enabled, Date.parse(created.createdAt), Date.parse(last.updatedAt));
    const wrongPath = fx.target.forJob(created.id).filter((c) => {
      const at = Date.parse(c.scheduledFor);
      const expected = paths.filter((p) => p.from < at - 150).at(-1);
      const next = paths.find((p) => p.from > at - 150 && p.from < at + 150);
      return expected && !next && c.path !== expected.path;
    });
    assert.deepEqual(
      wrongPath.map((c) => `${c.scheduledFor} ${c.path}`),
      [],
      'each call goes to the target in force when it was due',
    );
  },
);

test(
  'a pause while no leader dispatches still runs the occurrences that fell due before it',
  { timeout: 60_000 },
  async () => {
    // A second database that no scheduler serves: the dispatcher "lags" for as long as we like.
    const lagging = await createTestDatabase();
    const { node, apiUrl } = await startNode(
      'ops-worker',
      {
        databaseUrl: lagging.url,
        etcdPrefix: `${fx.etcdPrefix}-lag`,
        topic: `${fx.topic}.lag`,
        extra: { HELIOS_ROLES: 'worker,api' },
      },
      {},
    );
    fx.nodes.push(node);
    try {
      workerApi = apiUrl;
      const created = await fetch(`${workerApi}/api/v1/jobs`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({
          name: `lagging-${uniqueId()}`,
          schedule: '* * * * * *',
          target: { url: `${fx.target.url}/lagging`, method: 'POST' },
        }),
      }).then(async (r) => (await r.json()) as JobAnswer);
      await sleep(2500);
      const paused = await call(workerApi, 'POST', `/jobs/${created.id}/pause`);
      const dueBefore = Math.floor((Date.parse(paused.updatedAt) - 1) / 1000) * 1000;
      const due: string[] = [];
      for (let s = Math.ceil(Date.parse(created.createdAt) / 1000) * 1000; s <= dueBefore; s += 1000)
        due.push(new Date(s).toISOString());
      assert.ok(due.length >= 2, `occurrences due before the pause: ${due.length}`);
      // No relay runs (no leader): the worker's polling fallback executes them.
      const calls = await waitFor(
        'the occurrences due before the pause to be called',
        () => {
          const seen = fx.target.forJob(created.id).map((c) => c.scheduledFor);
          return due.every((d) => seen.includes(d)) ? seen : null;
        },
        15_000,
      );
      assert.deepEqual([...calls].sort(), due, 'each occurrence due before the pause called once');
    } finally {
      await node.stop();
      await lagging.drop();
    }
  },
);
