import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { uniqueId } from '../support/env.js';
import { attemptsOf, insertJob, nextWholeSecond, runsOf, stopJobs, waitFor } from '../support/execution.js';

// Runs due together on a worker with fewer slots than runs: all are claimed ahead (claims take no
// execution slot), each waits for a slot, and each attempt records when its call began, not the
// instant its claim recorded (its due time), which is seconds earlier for the last of a herd.

const CALL_MS = 400;
const RUNS = 3;

let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture({ behaviour: () => ({ status: 200, delayMs: CALL_MS }) });
  fx.spawn('ahead-1', { HELIOS_ROLES: 'scheduler,worker', HELIOS_WORKER_CONCURRENCY: '1' });
  await fx.nodes[0]!.waitForLog((l) => l.msg === 'became leader', 30_000);
  await fx.nodes[0]!.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
});
after(() => fx.teardown());

test(
  'runs due together on one slot are called one after another, each attempt started when its call began',
  { timeout: 40_000 },
  async () => {
    const due = await nextWholeSecond(fx.db.pool, 2000);
    const jobIds: string[] = [];
    for (let n = 0; n < RUNS; n++) {
      jobIds.push(
        await insertJob(fx.db.pool, {
          name: `ahead-${uniqueId()}`,
          schedule: `${due.getUTCSeconds()} ${due.getUTCMinutes()} ${due.getUTCHours()} * * *`,
          target: { url: `${fx.target.url}/slow` },
          nextRunAt: due,
          timeoutMs: 5000,
          maxAttempts: 1,
        }),
      );
    }
    const calls = await waitFor(
      `${RUNS} calls`,
      () => {
        const all = jobIds.flatMap((jobId) => fx.target.forJob(jobId));
        return all.length >= RUNS && all.every((c) => c.endedAt !== undefined) ? all : undefined;
      },
      RUNS * CALL_MS + 10_000,
    );
    await stopJobs(fx.db.pool, jobIds);
    calls.sort((a, b) => a.arrivedAt - b.arrivedAt);
    for (let i = 1; i < calls.length; i++) {
      assert.ok(calls[i]!.arrivedAt >= calls[i - 1]!.endedAt!, 'one slot: the calls did not overlap');
    }
    const last = calls.at(-1)!;
    assert.ok(last.arrivedAt - due.getTime() >= (RUNS - 1) * CALL_MS, 'the last call waited for the slot');
    for (const call of calls) {
      const [run] = await waitFor('the run settled', async () => {
        const runs = await runsOf(fx.db.pool, call.jobId);
        return runs[0]?.state === 'succeeded' ? runs : undefined;
      });
      const [attempt] = await attemptsOf(fx.db.pool, run!.id);
      const { rows } = await fx.db.pool.query<{ startedAt: Date }>(
        'SELECT started_at AS "startedAt" FROM runs WHERE id = $1',
        [run!.id],
      );
      // Same machine, so the target's clock and the database's agree within a few ms; the call
      // leaves the worker a little before it arrives.
      const skew = call.arrivedAt - attempt!.startedAt.getTime();
      assert.ok(
        skew >= -25 && skew <= 100,
        `attempt started ${skew.toFixed(0)} ms before its call arrived (${(call.arrivedAt - due.getTime()).toFixed(0)} ms after due)`,
      );
      assert.equal(
        rows[0]!.startedAt.getTime(),
        attempt!.startedAt.getTime(),
        'the run started with its attempt',
      );
    }
  },
);
