// test-runner: alone (stops and starts the shared servers)
import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { insertJob, nextWholeSecond, runsOf, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { infra, type ManagedProcess } from '../support/processes.js';

const OUTAGE_MS = 20_000;
let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture();
});
after(async () => {
  await infra('up', 'kafka'); // whatever happened, leave Kafka running for the next file
  await fx.teardown();
});

/** Sum of a counter's samples (with `labels` among their labels) over the nodes' /metrics. */
async function counter(name: string, labels: string): Promise<number> {
  let sum = 0;
  for (const node of fx.nodes) {
    const started = await node.waitForLog((l) => l.msg === 'node started');
    const text = await (await fetch(`${String(started.apiUrl)}/metrics`)).text();
    for (const line of text.split('\n')) {
      if (line.startsWith(`${name}{`) && line.includes(labels)) sum += Number(line.split(' ').at(-1));
    }
  }
  return sum;
}

test(
  'Kafka stopped for 20 s: due runs still execute through the polling fallback; after Kafka returns nothing is executed twice',
  { timeout: 150_000 },
  async () => {
    for (const [name, roles] of [
      ['outage-1', 'scheduler,worker'],
      ['outage-2', 'worker'],
    ] as const) {
      // Runs due within the lookahead of the outage were announced before it and fire on
      // time; a short lookahead leaves most of the outage to the polling fallback under test.
      fx.spawn(name, { HELIOS_ROLES: roles, HELIOS_DISPATCH_LOOKAHEAD_MS: '1000' });
    }
    await fx.nodes[0]!.waitForLog((l) => l.msg === 'became leader', 30_000);
    await Promise.all(fx.nodes.map((n) => n.waitForLog((l) => l.msg === 'joined consumer group', 30_000)));

    const start = await nextWholeSecond(fx.db.pool, 1000);
    const jobIds = await Promise.all(
      ['a', 'b', 'c'].map((n) =>
        insertJob(fx.db.pool, {
          name: `tick-${n}-${uniqueId()}`,
          schedule: '* * * * * *',
          target: { url: `${fx.target.url}/tick` },
          nextRunAt: start,
        }),
      ),
    );
    await sleep(start.getTime() - Date.now() + 3000); // a few runs through Kafka first
    assert.ok(fx.target.requests.length >= 6, 'runs execute through Kafka before the outage');

    await infra('down', 'kafka');
    const downAt = Date.now();
    await sleep(OUTAGE_MS);
    const upAt = Date.now();
    await infra('up', 'kafka');
    const backAt = Date.now();

    // The relay publishes the backlog, and once the consumers are back in the group (the restarted
    // coordinator waits out the old members first) a message for every run executed meanwhile
    // reaches a worker, whose claim finds the run already done.
    await waitFor(
      'the outbox backlog to be published',
      async () =>
        (
          await fx.db.pool.query<{ n: number }>(
            'SELECT count(*)::int AS n FROM outbox WHERE published_at IS NULL',
          )
        ).rows[0]!.n === 0,
      60_000,
      250,
    );
    const rejoined = (node: ManagedProcess) =>
      node.waitForLog((l) => l.msg === 'joined consumer group' && Date.parse(String(l.time)) > upAt, 60_000);
    await Promise.all(fx.nodes.map(rejoined));
    const outageRuns = async () =>
      (await Promise.all(jobIds.map((id) => runsOf(fx.db.pool, id))))
        .flat()
        .filter((r) => r.scheduledFor.getTime() > downAt + 1000 && r.scheduledFor.getTime() < upAt);
    const expectedLate = (await outageRuns()).length;
    await waitFor(
      'the late messages to be consumed',
      async () =>
        (await counter('helios_run_claims_total', 'source="kafka",result="missed"')) >= expectedLate,
      30_000,
      500,
    );
    await fx.db.pool.query('UPDATE jobs SET enabled = false');
    await sleep(3000);

    const runs = (await Promise.all(jobIds.map((id) => runsOf(fx.db.pool, id)))).flat();
    const during = await outageRuns();
    assert.ok(during.length >= 3 * 15, `runs due while Kafka was down: ${during.length}`);
    const notDone = runs.filter(
      (r) => r.state !== 'succeeded' && r.scheduledFor.getTime() < Date.now() - 5000,
    );
    assert.deepEqual(
      notDone.map((r) => [r.scheduledFor.toISOString(), r.state]),
      [],
      'every due run executed',
    );
    const counts = fx.target.countsByRun();
    for (const run of during) assert.equal(counts.get(run.id), 1, `run ${run.id} (due during the outage)`);
    assert.deepEqual(
      [...counts].filter(([, n]) => n > 1),
      [],
      'no run executed twice',
    );
    // The runs due during the outage were taken by polling, late by about the overdue threshold.
    const lateness = fx.target.requests
      .filter((r) => during.some((d) => d.id === r.runId))
      .map((r) => r.arrivedAt - Date.parse(r.scheduledFor));
    assert.ok(Math.min(...lateness) >= 1900, `polling took a run only ${Math.min(...lateness)} ms late`);
    assert.ok(Math.max(...lateness) < 6000, `a run was ${Math.max(...lateness)} ms late`);
    const polled = await counter('helios_run_claims_total', 'source="poll",result="claimed"');
    const lateMessages = await counter('helios_run_claims_total', 'source="kafka",result="missed"');
    assert.ok(polled >= during.length, `claimed by polling: ${polled}`);
    assert.ok(lateMessages >= during.length, `late messages ignored: ${lateMessages}`);
    console.log(
      `# Kafka down ${((upAt - downAt) / 1000).toFixed(1)} s (back ${((backAt - upAt) / 1000).toFixed(1)} s later); ` +
        `${during.length} runs due meanwhile, polled ${polled}, late messages ignored ${lateMessages}`,
    );
  },
);
