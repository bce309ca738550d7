import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { createEverySecondJob, firstToLead, pauseAndSettle } from '../support/every-second-job.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { startTogether } from '../support/start-together.js';

// README, "Every occurrence gets a run as long as a leader and PostgreSQL are back within
// HELIOS_MISFIRE_THRESHOLD_MS (5 s) of the occurrence: a kill -9 of the leader costs ≈3 s, so
// nothing is missed" — whatever the job's misfire policy, `skip` included.
//
// The dispatch lookahead is cut to 0 here: with the default 5 s the dead leader has already
// created the runs of the next 5 s, and the new leader would have nothing to catch up. At 0 every
// occurrence of the leaderless gap is created late, by the next leader, within the threshold.

const MISFIRE_THRESHOLD_MS = 5000;

let fixture: IntegrationFixture;

before(async () => {
  fixture = await integrationFixture();
});
after(async () => {
  await fixture.teardown();
});

test(
  'kill -9 of the leader: every occurrence of a misfire "skip" job still gets one run, created late by the next leader',
  { timeout: 90_000 },
  async () => {
    const settings = {
      HELIOS_DISPATCH_LOOKAHEAD_MS: '0',
      HELIOS_MISFIRE_THRESHOLD_MS: String(MISFIRE_THRESHOLD_MS),
      // A run the killed node had claimed comes back within about 2 s (timeout 1 s + grace 1 s).
      HELIOS_CLAIM_GRACE_MS: '1000',
    };
    // Started together (a node takes seconds to boot on a busy machine); one of them leads.
    const nodes = await startTogether(
      fixture,
      ['failover-1', 'failover-2'].map((name) => ({ name, extra: settings, wait: { worker: true } })),
    );
    const leading = await firstToLead(nodes);
    const leader = nodes[leading]!;
    const survivor = nodes[1 - leading]!;
    const job = await createEverySecondJob(survivor.apiUrl, fixture.target, 'failover');
    await waitFor('two calls before the kill', () => fixture.target.forJob(job.id).length >= 2, 20_000);
    const killedAt = Date.now();
    leader.node.signal('SIGKILL');
    await leader.node.exited;
    const became = await survivor.node.waitForLog((l) => l.msg === 'became leader', 20_000);
    const failoverMs = Date.parse(became.time as string) - killedAt;
    // A few occurrences after the new leader began, then stop the job.
    await waitFor(
      'calls after the failover',
      () =>
        fixture.target.forJob(job.id).filter((c) => Date.parse(c.scheduledFor) > killedAt + failoverMs + 1000)
          .length >= 2,
      20_000,
    );
    const paused = await pauseAndSettle(survivor.apiUrl, fixture.db.pool, job.id, 30_000);

    const { rows } = await fixture.db.pool.query<{ state: string; at: Date; createdAt: Date }>(
      `SELECT state, scheduled_for AS at, created_at AS "createdAt" FROM runs
       WHERE job_id = $1 AND trigger = 'schedule'`,
      [job.id],
    );
    const runs = new Map(rows.map((r) => [r.at.getTime(), r]));
    const calls = fixture.target.forJob(job.id);
    const from = Math.ceil((Date.parse(job.createdAt) + 150) / 1000) * 1000;
    const to = Date.parse(paused.updatedAt) - 150;
    const problems: string[] = [];
    let gap = 0;
    for (let s = from; s <= to; s += 1000) {
      const at = new Date(s).toISOString();
      const run = runs.get(s);
      if (!run) {
        problems.push(`${at}: no run`);
        continue;
      }
      if (run.state !== 'succeeded') problems.push(`${at}: ${run.state}`);
      if (!calls.some((c) => Date.parse(c.scheduledFor) === s)) problems.push(`${at}: never called`);
      // Created a second or more after its time: an occurrence of the leaderless gap, caught up
      // by the next leader (at lookahead 0 every run is created a few ms after its time).
      if (run.createdAt.getTime() - s > 1000) gap += 1;
    }
    console.log(`# failover ${failoverMs} ms; ${gap} occurrences created over 1 s late by the new leader`);
    assert.deepEqual(
      problems,
      [],
      'every occurrence from the job’s creation to its pause has one run that ran',
    );
    assert.ok(gap >= 1, 'the kill left occurrences for the next leader to create late');
  },
);
