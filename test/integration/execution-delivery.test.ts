import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { nextWholeSecond, oncePerMinuteAt, percentile, waitFor } from '../support/execution.js';

const RUNS = 500;
let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture();
});
after(() => fx.teardown());

test(
  `${RUNS} runs across 3 worker processes: each run executed exactly once`,
  { timeout: 120_000 },
  async () => {
    for (const [i, roles] of ['scheduler,worker', 'worker', 'worker'].entries()) {
      fx.spawn(`deliver-${i + 1}`, { HELIOS_ROLES: roles, HELIOS_KAFKA_PARTITIONS: '6' });
    }
    await fx.nodes[0]!.waitForLog((l) => l.msg === 'became leader', 30_000);
    await Promise.all(fx.nodes.map((n) => n.waitForLog((l) => l.msg === 'joined consumer group', 30_000)));
    // Each join rebalances the group; give the last rebalance time to settle so all three share it.
    await sleep(3000);

    // One job per run, all due at the same instant: a burst that the three workers share.
    const at = await nextWholeSecond(fx.db.pool, 2000);
    await fx.db.pool.query(
      `INSERT INTO jobs (name, schedule, target, next_run_at)
     SELECT 'burst-' || n, $1, $2, $3 FROM generate_series(1, $4) AS n`,
      [
        oncePerMinuteAt(at),
        { url: `${fx.target.url}/hook`, method: 'POST', body: { hello: 'world' } },
        at,
        RUNS,
      ],
    );

    const succeeded = async () =>
      (await fx.db.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM runs WHERE state = 'succeeded'`))
        .rows[0]!.n;
    await waitFor(`${RUNS} succeeded runs`, async () => (await succeeded()) === RUNS, 40_000, 200);
    await sleep(2000); // a duplicate would arrive by now (messages were all consumed long ago)

    const counts = fx.target.countsByRun();
    const { rows: runs } = await fx.db.pool.query<{ id: string; attempt: number }>(
      `SELECT id, attempt FROM runs`,
    );
    assert.equal(runs.length, RUNS);
    assert.deepEqual(
      new Set(counts.keys()),
      new Set(runs.map((r) => r.id)),
      'the target saw exactly our runs',
    );
    const twice = [...counts].filter(([, n]) => n !== 1);
    assert.deepEqual(twice, [], 'no run was executed twice');
    assert.ok(runs.every((r) => r.attempt === 1));
    assert.ok(
      fx.target.requests.every((r) => r.idempotencyKey === r.runId && r.body === '{"hello":"world"}'),
    );

    const { rows: byNode } = await fx.db.pool.query<{ nodeId: string; n: number }>(
      `SELECT node_id AS "nodeId", count(*)::int AS n FROM run_attempts GROUP BY node_id ORDER BY node_id`,
    );
    assert.equal(byNode.length, 3, `every worker took part: ${JSON.stringify(byNode)}`);
    const lateness = fx.target.requests.map((r) => r.arrivedAt - Date.parse(r.scheduledFor));
    console.log(
      `# ${RUNS} runs at one instant over 3 workers ${JSON.stringify(byNode)}; lateness ms p50 ` +
        `${percentile(lateness, 50).toFixed(1)} p99 ${percentile(lateness, 99).toFixed(1)} max ` +
        `${Math.max(...lateness).toFixed(1)}`,
    );
  },
);
