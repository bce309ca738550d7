import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type pg from 'pg';
import { completeSucceededMany, failMany } from '../../src/store/attempts.js';
import { releaseClaims } from '../../src/store/releases.js';
import { claimRuns, findLostClaims } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// The claim and completion statements touch a batch of runs by id. Their plans must stay primary-
// key lookups however stale the statistics are: in a herd, thousands of runs become queued and then
// running within seconds of an ANALYZE that saw none, and a plan that scans the partial index of
// queued or running runs costs O(all of them) per batch instead of O(batch).

let db: TestDatabase;
let client: pg.PoolClient;
const RUNS = 3000;
/** A herd's size: the last test's plans differ with fewer runs (with 3,000, a hash join hid the loop over the input). */
const HERD = 10_000;
const options = { nodeId: 'plan-node', graceMs: 5000, skewToleranceMs: 10, leadMs: 50 };

before(async () => {
  db = await createTestDatabase();
  client = await db.pool.connect();
  await client.query(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts)
     SELECT 'plan-' || n, '0 0 1 1 *', '{"url":"http://127.0.0.1:9/"}', 5000, 3 FROM generate_series(1, $1) AS n`,
    [RUNS],
  );
  // Statistics taken while no run exists, as between two busy periods.
  await client.query('ANALYZE runs');
  await client.query('ANALYZE run_attempts');
  await client.query(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, now(), 'queued', max_attempts, target, timeout_ms, backoff_ms, backoff_multiplier,
            concurrency, now() - interval '1 second'
     FROM jobs`,
  );
});
after(async () => {
  client.release();
  await db.drop();
});

/** Every scan node of a JSON plan: [node type, index name or relation]. */
function scans(plan: Record<string, unknown>): string[] {
  const own =
    typeof plan['Node Type'] === 'string' && /Scan/.test(plan['Node Type'])
      ? [`${plan['Node Type']} ${String(plan['Index Name'] ?? plan['Relation Name'] ?? '')}`]
      : [];
  const children = (plan.Plans as Record<string, unknown>[] | undefined) ?? [];
  return [...own, ...children.flatMap(scans)];
}

/** Nested loops that rescan the whole of `runs` for each row of their other side: O(table × batch). */
function loopsOverRuns(plan: Record<string, unknown>): string[] {
  const children = (plan.Plans as Record<string, unknown>[] | undefined) ?? [];
  const own =
    plan['Node Type'] === 'Nested Loop' &&
    children.some((c) => c['Node Type'] === 'Seq Scan' && c['Relation Name'] === 'runs')
      ? ['Nested Loop over Seq Scan runs']
      : [];
  return [...own, ...children.flatMap(loopsOverRuns)];
}

/**
 * Nested loops whose inner side is a scan of a CTE or of a function (the statement's own input):
 * rescanned once per row of the outer side, so the statement costs O(batch²).
 */
function loopsOverInput(plan: Record<string, unknown>): string[] {
  const children = (plan.Plans as Record<string, unknown>[] | undefined) ?? [];
  const inner = children.find((c) => c['Parent Relationship'] === 'Inner');
  const own =
    plan['Node Type'] === 'Nested Loop' &&
    (inner?.['Node Type'] === 'CTE Scan' || inner?.['Node Type'] === 'Function Scan')
      ? [
          `Nested Loop over ${String(inner['Node Type'])} ${String(inner['CTE Name'] ?? inner['Function Name'] ?? '')}`,
        ]
      : [];
  return [...own, ...children.flatMap(loopsOverInput)];
}

/** The named statement's plan, custom and generic, for these parameters, on connection `on`. */
async function plans(
  statement: string,
  params: string,
  on: pg.PoolClient = client,
): Promise<{ mode: string; plan: Record<string, unknown> }[]> {
  const out: { mode: string; plan: Record<string, unknown> }[] = [];
  for (const mode of ['force_custom_plan', 'force_generic_plan']) {
    await on.query(`SET plan_cache_mode = ${mode}`);
    const { rows } = await on.query<{ 'QUERY PLAN': { Plan: Record<string, unknown> }[] }>(
      `EXPLAIN (FORMAT JSON) EXECUTE "${statement}" (${params})`,
    );
    out.push({ mode, plan: rows[0]!['QUERY PLAN'][0]!.Plan });
  }
  await on.query('RESET plan_cache_mode');
  return out;
}

/** Scans on `runs` of the named statement's plan, custom and generic, for these parameters. */
async function runsScans(statement: string, params: string): Promise<string[]> {
  return (await plans(statement, params)).flatMap(({ plan }) =>
    scans(plan).filter((s) => /runs_|on runs|Scan runs$/.test(s)),
  );
}

/** The completion statement's parameters for a batch of runs claimed by 'plan-node'. */
function completionParams(runs: readonly { id: string }[]): string {
  return [
    literal(runs.map((r) => r.id)),
    literal(runs.map(() => 1)),
    literal(runs.map(() => 200)),
    literal(runs.map(() => 1)),
    literal(runs.map(() => 'ok')),
    "'plan-node'",
    literal(runs.map(() => 'NULL')), // when each call began: the claim's start stands
  ].join(', ');
}

const report = {
  outcome: 'succeeded' as const,
  statusCode: 200,
  durationMs: 1,
  error: null,
  responseExcerpt: 'ok',
};

const literal = (values: readonly (string | number)[]) => `'{${values.join(',')}}'`;

test('a claim batch looks its runs up by primary key, even with thousands queued and statistics that saw none', async () => {
  const { rows } = await client.query<{ id: string }>('SELECT id FROM runs ORDER BY id LIMIT 16');
  const ids = rows.map((r) => r.id);
  const claimed = await claimRuns(
    client,
    ids.map((runId) => ({ runId, expectedAttempt: 1 })),
    options,
  );
  assert.equal(claimed.filter(Boolean).length, ids.length);
  const other = (await client.query<{ id: string }>('SELECT id FROM runs WHERE attempt = 0 LIMIT 16')).rows;
  const found = await runsScans(
    'helios-claim-runs',
    `${literal(other.map((r) => r.id))}, 'plan-node', 5000, 10, ${literal(other.map(() => 1))}, 50, 5000, 7, 'cluster/helios/leader'`,
  );
  assert.ok(found.length > 0, 'the plan has scans on runs');
  // runs_one_per_occurrence: the misfire test's later occurrences of a fire-once job
  // (misfiredAtClaim), made only for a run due longer ago than the threshold and never claimed.
  assert.deepEqual(
    found.filter(
      (s) =>
        !s.endsWith('runs_pkey') &&
        !s.endsWith('runs_active_job_idx') &&
        !s.endsWith('runs_one_per_occurrence'),
    ),
    [],
    `scans: ${found.join('; ')}`,
  );
});

test('a completion batch looks its runs up by primary key, even with thousands running and statistics that saw none', async () => {
  const { rows } = await client.query<{ id: string }>('SELECT id FROM runs WHERE attempt = 0 ORDER BY id');
  const claimed = await claimRuns(
    client,
    rows.map((r) => ({ runId: r.id, expectedAttempt: 1 })),
    options,
  );
  const running = claimed.filter((r) => r !== null);
  assert.ok(running.length > 2000, `${running.length} runs running`);
  const batch = running.slice(0, 16);
  const done = await completeSucceededMany(
    client,
    options.nodeId,
    batch.map((run) => ({ run, report })),
  );
  assert.deepEqual(new Set(done), new Set([true]));
  const next = running.slice(16, 32);
  const found = await runsScans('helios-complete-succeeded', completionParams(next));
  assert.ok(found.length > 0, 'the plan has scans on runs');
  assert.deepEqual(
    found.filter((s) => !s.endsWith('runs_pkey')),
    [],
    `scans: ${found.join('; ')}`,
  );
});

test('the claim watch looks each claim up by primary key, not by scanning every run', async () => {
  // A worker in a herd watches a few hundred claims (its slots and start passes) once a second;
  // as a join, the planner ran that check as a hash join over a scan of the whole table.
  const { rows } = await client.query<{ id: string }>('SELECT id FROM runs ORDER BY id LIMIT 576');
  const watched = rows.map((r) => ({ runId: r.id, attempt: 1 }));
  await findLostClaims(client, watched, 'plan-node'); // prepares the named statement
  const found = await runsScans(
    'helios-lost-claims',
    `${literal(watched.map((w) => w.runId))}, ${literal(watched.map(() => 1))}, 'plan-node'`,
  );
  assert.ok(found.length > 0, 'the plan has scans on runs');
  assert.deepEqual(
    found.filter((s) => !s.endsWith('runs_pkey')),
    [],
    `scans: ${found.join('; ')}`,
  );
});

test('completion and failure batches never loop over a scan of all runs, nor over their input, when the statistics saw thousands queued and none claimed', async () => {
  // Autovacuum vacuums and analyses `runs` seconds after a herd's dispatch inserted it: every run queued, no
  // `claimed_by` yet. The planner then takes `claimed_by = $6` to match almost nothing and, with a
  // few thousand rows, scanned the whole table once per completion batch (960 ms for 256 runs).
  const other = await createTestDatabase();
  const c = await other.pool.connect();
  try {
    await c.query(
      `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts)
       SELECT 'plan-' || n, '0 0 1 1 *', '{"url":"http://127.0.0.1:9/"}', 5000, 3 FROM generate_series(1, $1) AS n`,
      [HERD],
    );
    const { rows } = await c.query<{ id: string }>(
      `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                         backoff_multiplier, concurrency, not_before)
       SELECT id, now(), 'queued', max_attempts, target, timeout_ms, backoff_ms, backoff_multiplier,
              concurrency, now() - interval '1 second'
       FROM jobs RETURNING id`,
    );
    await c.query('VACUUM ANALYZE runs');
    await c.query('VACUUM ANALYZE run_attempts');
    const claimed = (
      await claimRuns(
        c,
        rows.map((r) => ({ runId: r.id, expectedAttempt: 1 })),
        options,
      )
    ).filter((r) => r !== null);
    assert.equal(claimed.length, HERD);
    // Completing one batch prepares the named statement on this connection.
    const first = claimed.slice(0, 16);
    assert.deepEqual(
      new Set(
        await completeSucceededMany(
          c,
          options.nodeId,
          first.map((run) => ({ run, report })),
        ),
      ),
      new Set([true]),
    );
    // A seq scan joined by hash is a fair plan for a table this small (one pass per batch); the
    // plan must not join by looping over a scan of the whole table (one pass per run).
    const batch = claimed.slice(16, 16 + 256);
    for (const { mode, plan } of await plans('helios-complete-succeeded', completionParams(batch), c)) {
      assert.deepEqual(loopsOverRuns(plan), [], mode);
      // Nor by looping over its own input: a second join of the completed runs with the input,
      // estimated at one row a side, rescanned the input for every completed run (O(batch²):
      // 15 of a 256-run batch's 20 ms).
      assert.deepEqual(loopsOverInput(plan), [], mode);
    }
    // The failure statement (execution/batching.ts) joins the same way: failing one batch prepares it.
    const failing = claimed.slice(16 + 256, 16 + 256 + 16);
    const failure = { ...report, outcome: 'failed' as const, statusCode: 503, error: 'HTTP 503' };
    const topics = { runsTopic: 'plans.runs', deadLetterTopic: 'plans.dlq' };
    const settled = await failMany(
      c,
      options.nodeId,
      failing.map((run) => ({ run, report: failure, retryDelayMs: 1000 })),
      topics,
    );
    assert.deepEqual(new Set(settled.map((r) => r?.state)), new Set(['queued']));
    const next = claimed.slice(16 + 256 + 16, 16 + 256 + 16 + 256);
    const failParams = [
      literal(next.map((r) => r.id)),
      `'${options.nodeId}'`,
      literal(next.map(() => 1)),
      literal(next.map(() => 1000)),
      literal(next.map(() => 503)),
      literal(next.map(() => 'HTTP 503')),
      literal(next.map(() => 'false')),
      literal(next.map(() => 'NULL')),
      literal(next.map(() => 'failed')),
      literal(next.map(() => 1)),
      literal(next.map(() => 'x')),
      "'plans.runs'",
      "'plans.dlq'",
      'true', // retries only, as the worker's batches of retries are
    ].join(', ');
    for (const { mode, plan } of await plans('helios-fail-many', failParams, c)) {
      assert.deepEqual(loopsOverRuns(plan), [], `failure, ${mode}`);
      assert.deepEqual(loopsOverInput(plan), [], `failure, ${mode}`);
    }
    // And the release statement (a stopping worker's hand-backs): releasing one batch prepares it.
    const handedBack = { ...report, outcome: 'cancelled' as const, statusCode: null, error: 'stopping' };
    const releasing = next.slice(0, 16);
    const released = await releaseClaims(
      c,
      options.nodeId,
      releasing.map((run) => ({ run, report: handedBack })),
      topics.runsTopic,
    );
    assert.equal(released.filter((r) => r !== null).length, 16);
    const toRelease = claimed.slice(16 + 256 + 16 + 256, 16 + 256 + 16 + 256 + 256);
    const releaseParams = [
      literal(toRelease.map((r) => r.id)),
      `'${options.nodeId}'`,
      literal(toRelease.map(() => 1)),
      literal(toRelease.map(() => 'cancelled')),
      literal(toRelease.map(() => 'NULL')),
      literal(toRelease.map(() => 'stopping')),
      literal(toRelease.map(() => 'NULL')),
      literal(toRelease.map(() => 'NULL')),
      literal(toRelease.map(() => 'NULL')),
      "'plans.runs'",
      // Expiry bounds: replace-failed hand-backs count with the forgiven expiries, the others not.
      literal(toRelease.map((_, k) => (k % 2 === 0 ? 'NULL' : 2))),
    ].join(', ');
    for (const { mode, plan } of await plans('helios-release-many', releaseParams, c)) {
      assert.deepEqual(loopsOverRuns(plan), [], `release, ${mode}`);
      assert.deepEqual(loopsOverInput(plan), [], `release, ${mode}`);
    }
  } finally {
    c.release();
    await other.drop();
  }
});
