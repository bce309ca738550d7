import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { attemptsOf, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { scrapeMetrics } from '../support/metrics.js';
import { apiCall } from '../support/node-api.js';
import type { ManagedProcess } from '../support/processes.js';
import { startTogether } from '../support/start-together.js';

// README, "Execution is claimed before it happens": a worker that dies while holding announcements
// of runs not yet due (the dispatcher publishes up to the lookahead early; a worker commits a
// message's offset once it holds it, so Kafka does not deliver it again) loses nothing: the other
// workers claim those runs once they are HELIOS_POLL_OVERDUE_MS (2 s) overdue.
//
// The survivor consumes another topic, so it can only reach these runs through the polling
// fallback, the worst case: in the same consumer group it could only get them sooner, from Kafka.
// The settings are the defaults (poll every 1 s, 2 s overdue, 5.5 s lookahead).

const POLL_OVERDUE_MS = 2000;
const POLL_INTERVAL_MS = 1000;
/** A call may start this much before its time by our clock (clock-estimate rounding). */
const EARLY_TOLERANCE_MS = 25;

let fixture: IntegrationFixture;
let api: string;
let holder: { node: ManagedProcess; apiUrl: string };

before(async () => {
  fixture = await integrationFixture();
  // Started together (a node takes seconds to boot on a busy machine). The leader only schedules
  // (and serves the API): no worker on it.
  const [leader, w1] = await startTogether(fixture, [
    { name: 'held-leader', extra: { HELIOS_ROLES: 'scheduler,api' }, wait: { leader: true } },
    { name: 'held-w1', extra: { HELIOS_ROLES: 'worker' }, wait: { worker: true } },
    {
      name: 'held-w2',
      extra: {
        HELIOS_ROLES: 'worker',
        HELIOS_KAFKA_TOPIC: `${fixture.topic}.quiet`,
        HELIOS_KAFKA_DLQ_TOPIC: `${fixture.topic}.quiet.dlq`,
        HELIOS_KAFKA_GROUP: `${fixture.topic}.quiet.workers`,
        HELIOS_POLL_OVERDUE_MS: String(POLL_OVERDUE_MS),
        HELIOS_POLL_INTERVAL_MS: String(POLL_INTERVAL_MS),
      },
      wait: { worker: true },
    },
  ]);
  api = leader!.apiUrl;
  holder = w1!;
});
after(async () => {
  await fixture.teardown();
});

test(
  'kill -9 of a worker holding announced runs not yet due: another worker claims them once 2 s overdue',
  { timeout: 60_000 },
  async () => {
    const job = await apiCall<{ id: string }>(api, 'POST', '/jobs', {
      name: `held-${uniqueId()}`,
      schedule: '* * * * * *',
      target: { url: `${fixture.target.url}/held`, method: 'POST' },
    });
    // The holder executes the job's runs as they fall due and holds the next ones (up to 5.5 s ahead).
    await waitFor('a call by the holder', () => fixture.target.forJob(job.id).length > 0, 20_000);
    const held = await waitFor('the holder to hold announcements of 3 runs', async () => {
      const value = (await scrapeMetrics(holder.apiUrl)).value('helios_worker_held_runs') ?? 0;
      return value >= 3 ? value : null;
    });
    holder.node.signal('SIGKILL');
    await holder.node.exited;
    // What the dead worker left: every queued run of the job, due or not (it can claim nothing now).
    const { rows: left } = await fixture.db.pool.query<{ id: string; scheduledFor: Date }>(
      `SELECT id, scheduled_for AS "scheduledFor" FROM runs
       WHERE job_id = $1 AND state = 'queued' AND attempt = 0 ORDER BY scheduled_for`,
      [job.id],
    );
    assert.ok(left.length >= held, `${left.length} queued runs, ${held} announcements held`);
    const ids = left.map((r) => r.id);

    const ended = await waitFor(
      'the runs the dead worker held to end',
      async () => {
        const { rows } = await fixture.db.pool.query<{ id: string; state: string }>(
          'SELECT id, state FROM runs WHERE id = ANY($1::uuid[])',
          [ids],
        );
        return rows.length === ids.length && rows.every((r) => !['queued', 'running'].includes(r.state))
          ? rows
          : null;
      },
      // The last one is due up to 5.5 s after the kill, then 2-3 s overdue: 20 s is ample.
      20_000,
    );
    const problems: string[] = [];
    const lateness: number[] = [];
    for (const run of left) {
      const at = run.scheduledFor.toISOString();
      const state = ended.find((r) => r.id === run.id)!.state;
      if (state !== 'succeeded') problems.push(`${at}: ${state}`);
      const attempts = await attemptsOf(fixture.db.pool, run.id);
      const nodes = attempts.map((a) => a.nodeId);
      if (nodes.join() !== 'held-w2') problems.push(`${at}: attempts by ${nodes.join() || 'nobody'}`);
      const calls = fixture.target.requests.filter((r) => r.runId === run.id);
      if (calls.length !== 1) problems.push(`${at}: ${calls.length} calls`);
      for (const c of calls) {
        const late = c.arrivedAt - run.scheduledFor.getTime();
        lateness.push(late);
        // Only the polling fallback can have claimed it: not before it was 2 s overdue.
        if (late < POLL_OVERDUE_MS - EARLY_TOLERANCE_MS)
          problems.push(`${at}: called ${late.toFixed(0)} ms late`);
      }
    }
    assert.deepEqual(problems, [], `the ${left.length} runs the dead worker held`);
    // Reported, not asserted (lateness is not promised): overdue to overdue + interval, plus load.
    console.log(
      `# ${left.length} held runs claimed by polling, ${lateness.map((l) => l.toFixed(0)).join(', ')} ms late`,
    );
  },
);
