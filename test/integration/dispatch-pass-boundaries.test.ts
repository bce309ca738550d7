// A job at the boundary of a dispatch pass that is full (5,000 runs), with other late jobs behind
// it: its plan must go whole in one pass or the next, never be cut. d09e1b2 cut such a plan, left
// the job due from its first occurrence not created, and that continuation, late, waited behind
// every older late job and was planned again by the misfire rule from a later cutoff: both tests
// failed there (occurrences of the first plan lost; on-time occurrences dropped).
import assert from 'node:assert/strict';
import { DEFAULT_DISPATCH_LOOKAHEAD_MS } from '../../src/config/index.js';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { scrapeMetrics } from '../support/metrics.js';

let fx: IntegrationFixture;
before(async () => {
  fx = await integrationFixture();
});
after(() => fx.teardown());

const HERD = 20;

/**
 * Late jobs, oldest first: `fill` (fire-all, every second of an hour 12 h away, so no on-time
 * occurrence, exactly `5000 - room` runs), then the probe job (every second, `misfire`, maxCatchUp
 * 5), then HERD jobs like `fill` with 5,000 runs each (one pass each), whose next_run_at lie between
 * the probe's first one and the occurrence its cut leaves it at.
 */
async function setUp(tag: string, room: number, misfire: string): Promise<string> {
  await fx.db.pool.query('UPDATE jobs SET enabled = false');
  const hour = (new Date().getUTCHours() + 12) % 24;
  const insert = (name: string, schedule: string, misfire: string, maxCatchUp: number, ago: string) =>
    fx.db.pool.query<{ id: string }>(
      `INSERT INTO jobs (name, schedule, timezone, target, misfire, max_catch_up, next_run_at)
       VALUES ($1, $2, 'UTC', '{"url":"http://127.0.0.1:9/"}', $3, $4, now() - $5::interval) RETURNING id`,
      [name, schedule, misfire, maxCatchUp, ago],
    );
  await insert(`${tag}-fill`, `* * ${hour} * * *`, 'fire-all', 5000 - room, '4 days');
  const probe = (await insert(`${tag}-probe`, '* * * * * *', misfire, 5, '3 days')).rows[0]!.id;
  for (let i = 0; i < HERD; i++)
    await insert(`${tag}-herd-${i}`, `* * ${hour} * * *`, 'fire-all', 5000, `2 days - ${i} seconds`);
  return probe;
}

async function runUntilCaughtUp(name: string, slowFirstPassMs: number) {
  // Optionally hold the first pass's insert (the outbox, which CREATE_RUNS writes) for a while: a
  // pass of 16 MiB of runs takes about that long (a review measured 1.5 s for 64 MB).
  const lock = await fx.db.pool.connect();
  if (slowFirstPassMs > 0) await lock.query('BEGIN; LOCK TABLE outbox IN SHARE MODE');
  const node = fx.spawn(name, { HELIOS_ROLES: 'scheduler,api' });
  const started = await node.waitForLog((l) => l.msg === 'node started', 15_000);
  await node.waitForLog((l) => l.msg === 'became leader', 15_000);
  if (slowFirstPassMs > 0) {
    await sleep(slowFirstPassMs);
    await lock.query('COMMIT');
  }
  lock.release();
  await waitFor(
    'every job caught up',
    async () =>
      (
        await fx.db.pool.query(
          `SELECT 1 FROM jobs WHERE enabled AND next_run_at < now()
           HAVING count(*) = 0`,
        )
      ).rowCount,
    120_000,
  );
  const metrics = await scrapeMetrics(started.apiUrl as string);
  await fx.db.pool.query('UPDATE jobs SET enabled = false');
  await node.stop();
  return metrics;
}

/** The probe's runs, and which seconds its first pass planned that have no run. */
async function probeReport(probe: string) {
  const { rows: runs } = await fx.db.pool.query<{ at: Date; createdAt: Date }>(
    `SELECT scheduled_for AS at, created_at AS "createdAt" FROM runs WHERE job_id = $1 ORDER BY scheduled_for`,
    [probe],
  );
  const firstPass = runs[0]!.createdAt.getTime();
  const horizon = firstPass + DEFAULT_DISPATCH_LOOKAHEAD_MS;
  const have = new Set(runs.map((r) => r.at.getTime()));
  const missing: string[] = [];
  for (let t = runs[0]!.at.getTime(); t <= horizon; t += 1000)
    if (!have.has(t)) missing.push(new Date(t).toISOString());
  const passes = new Map<number, string[]>();
  for (const r of runs) {
    const k = r.createdAt.getTime() - firstPass;
    passes.set(k, [...(passes.get(k) ?? []), r.at.toISOString().slice(11, 19)]);
  }
  // Occurrences still in the future when the first pass planned them, created after they were due.
  const createdLate = runs.filter(
    (r) => r.at.getTime() > firstPass && r.at.getTime() <= horizon && r.createdAt > r.at,
  ).length;
  const late = runs.filter((r) => r.createdAt.getTime() - r.at.getTime() > 5000).length;
  return { firstPass: new Date(firstPass).toISOString(), missing, passes: [...passes], createdLate, late };
}

/**
 * The probe after a catch-up in which its plan met a full pass with `room` runs left, the first
 * pass held `slowFirstPassMs`; its misfires counted, by policy, and both said in the output.
 */
async function probeAfterCatchUp(tag: string, room: number, misfire: string, slowFirstPassMs: number) {
  const probe = await setUp(tag, room, misfire);
  const metrics = await runUntilCaughtUp(`cut-${tag}`, slowFirstPassMs);
  const report = await probeReport(probe);
  const misfires = metrics.find('helios_misfires_total');
  console.log(`# ${JSON.stringify(report)} misfires ${JSON.stringify(misfires)}`);
  return { report, misfires: (policy: string) => metrics.value('helios_misfires_total', { policy }) };
}

test('a fire-all job with room for 2 runs left in a full pass, older late jobs behind it: no occurrence of its plan lost or late', async () => {
  const { report } = await probeAfterCatchUp('fire-all', 2, 'fire-all', 0);
  assert.deepEqual(report.missing, [], 'seconds the first pass planned that never got a run');
  assert.equal(
    report.createdLate,
    0,
    'occurrences in the first pass’s lookahead created after they were due',
  );
  assert.ok(report.late <= 5, `${report.late} late runs for maxCatchUp 5`);
});

test('a fire-once job with room for 1 run left in a slow full pass: none of its on-time occurrences dropped', async () => {
  const { report, misfires } = await probeAfterCatchUp('fire-once', 1, 'fire-once', 2000);
  assert.deepEqual(report.missing, [], 'seconds the first pass planned on time that never got a run');
  assert.equal(misfires('fire-once'), 1, "the probe's misfire counted once");
});
