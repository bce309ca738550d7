import assert from 'node:assert/strict';
import { pino } from 'pino';
import { after, before, beforeEach, test } from 'node:test';
import { createMetrics } from '../../src/observability/metrics.js';
import { inTransaction, type Queryable } from '../../src/store/db.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { readClusterCounts } from '../../src/store/signals.js';
import { pollOverdue } from '../../src/execution/poller.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// A `forbid` job's retry or replay is never skipped: it stays queued while another run of the job
// runs (a call may take minutes) and starts once that run ends. It is waiting its turn, not stuck:
// the leader must not count it in helios_runs_overdue (HeliosRunsOverdueGrowing's input, which one
// such wait fed for as long as it lasted), and the workers' polling fallback must not try to claim
// it on every poll meanwhile, yet claim it at the first poll after the other run ends.

let db: TestDatabase;

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());
// Each test's runs alone (cascades to them).
beforeEach(() => db.pool.query('DELETE FROM jobs'));

async function job(concurrency: 'forbid' | 'allow'): Promise<string> {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     VALUES ('wf-' || gen_random_uuid(), '0 0 1 1 *', '{"url":"http://127.0.0.1:9/"}', 600000, 3, $1,
             now() + interval '1 day') RETURNING id`,
    [concurrency],
  );
  return rows[0]!.id;
}

/** A run of `jobId`: running (claimed by node-a, its call of minutes underway) or queued `agoMs` overdue. */
async function run(
  jobId: string,
  state: 'running' | 'queued',
  attempt: number,
  agoMs = 600_000,
): Promise<string> {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before, claimed_by, claim_expires_at, started_at)
     SELECT id, now() - $3 * interval '1 millisecond' - random() * interval '1 hour', $2, $4, 3, target,
            timeout_ms, 100, 2, concurrency, now() - $3 * interval '1 millisecond',
            CASE WHEN $2 = 'running' THEN 'node-a' END,
            CASE WHEN $2 = 'running' THEN now() + interval '10 minutes' END,
            CASE WHEN $2 = 'running' THEN now() END
     FROM jobs WHERE id = $1 RETURNING id`,
    [jobId, state, agoMs, attempt],
  );
  return rows[0]!.id;
}

test('a forbid retry waiting for its running sibling is counted waiting, not overdue', async () => {
  const forbid = await job('forbid');
  await run(forbid, 'running', 1);
  await run(forbid, 'queued', 1); // a replay (or a retry) behind it, 10 minutes overdue
  // Really overdue: an `allow` run nobody claimed, and a forbid retry whose job runs nothing.
  await run(await job('allow'), 'queued', 1);
  await run(await job('forbid'), 'queued', 1);
  const counts = await readClusterCounts(db.pool, 5000, 100_000);
  assert.deepEqual(
    { overdue: counts.runsOverdue, waiting: counts.runsWaitingForbid, running: counts.runsRunning },
    { overdue: 2, waiting: 1, running: 1 },
  );
});

test('the polling fallback leaves a waiting forbid retry alone while its sibling runs, and claims it at the next poll after', async () => {
  const forbid = await job('forbid');
  const sibling = await run(forbid, 'running', 1);
  const waiting = await run(forbid, 'queued', 1);
  const metrics = createMetrics('waiting-forbid');
  const statements: string[] = [];
  const claimed: ClaimedRun[] = [];
  const lines: string[] = [];
  let polls = 0;
  const abort = new AbortController();
  const options = { nodeId: 'node-b', graceMs: 5000, skewToleranceMs: 10, misfireThresholdMs: 5000 };
  const loop = pollOverdue({
    claimOverdue: (overdueMs, limit) =>
      inTransaction(db.pool, async (client) => {
        polls += 1;
        const query = client.query;
        // Every statement of the poll but its BEGIN and COMMIT (inTransaction's, not the poll's).
        client.query = ((text: string | { text: string }, values?: unknown[]) => {
          const sql = typeof text === 'string' ? text : text.text;
          statements.push(sql.trim().split(/\s+/).slice(0, 3).join(' '));
          return (query as (t: unknown, v?: unknown[]) => unknown).call(client, text, values);
        }) as typeof client.query;
        try {
          return await claimOverdueRuns(client, overdueMs, limit, options);
        } finally {
          client.query = query;
        }
      }),
    syncClock: async () => undefined,
    intervalMs: 100,
    overdueMs: 2000,
    capacity: () => 10,
    reserve: () => () => undefined,
    execute: (runs) => claimed.push(...runs),
    logger: pino({ level: 'debug' }, { write: (line: string) => void lines.push(line) }),
    metrics,
    signal: abort.signal,
  });
  try {
    await new Promise((resolve) => setTimeout(resolve, 1500));
    const pollsWhileWaiting = polls;
    const whileWaiting = statements.splice(0);
    assert.ok(pollsWhileWaiting >= 5, `${pollsWhileWaiting} polls in 1.5 s`);
    // One SELECT a poll, and nothing else: no claim, no savepoint, no claim missed or explained.
    assert.deepEqual(
      [...new Set(whileWaiting)],
      [whileWaiting[0]],
      `statements of ${pollsWhileWaiting} polls: ${whileWaiting.join(' | ')}`,
    );
    assert.equal(whileWaiting.length, pollsWhileWaiting);
    assert.equal(claimed.length, 0);
    assert.deepEqual(lines.splice(0), [], 'log lines while the retry waits');
    const claims = await metrics.registry.getSingleMetricAsString('helios_run_claims_total');
    assert.doesNotMatch(claims, /source="poll"/, 'claims counted while the retry waits');
    // The sibling ends: the next poll claims the retry.
    const ended = Date.now();
    await db.pool.query(
      `UPDATE runs SET state = 'succeeded', finished_at = now(), claim_expires_at = NULL WHERE id = $1`,
      [sibling],
    );
    while (claimed.length === 0 && Date.now() - ended < 2000) await new Promise((r) => setTimeout(r, 20));
    assert.deepEqual(
      claimed.map((r) => [r.id, r.attempt]),
      [[waiting, 2]],
    );
    assert.ok(Date.now() - ended < 500, `claimed ${Date.now() - ended} ms after the sibling ended`);
  } finally {
    abort.abort();
    await loop;
  }
});

/** Every scan node of a JSON plan with the rows it read (returned or filtered out) over all its loops. */
function scans(plan: Record<string, unknown>): { node: string; rows: number }[] {
  const own =
    typeof plan['Node Type'] === 'string' && /Scan/.test(plan['Node Type'])
      ? [
          {
            node: `${plan['Node Type']} ${String(plan['Index Name'] ?? plan['Relation Name'] ?? '')}`,
            rows:
              (Number(plan['Actual Rows']) + Number(plan['Rows Removed by Filter'] ?? 0)) *
              Number(plan['Actual Loops']),
          },
        ]
      : [];
  const children = (plan.Plans as Record<string, unknown>[] | undefined) ?? [];
  return [...own, ...children.flatMap(scans)];
}

test('the counts read a backlog of 30,000 overdue runs twice (queued, overdue), not a third time for the forbid waits', async () => {
  const QUEUED = 30_000;
  await db.pool.query(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     SELECT 'bl-' || n, '0 0 1 1 *', '{"url":"http://127.0.0.1:9/"}', 600000, 3,
            CASE WHEN n % 100 = 0 THEN 'forbid' ELSE 'allow' END, now() + interval '1 day'
     FROM generate_series(1, $1) n`,
    [QUEUED],
  );
  // Every job has an overdue run, retries among them; one `forbid` job in 100 also runs one.
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, now() - interval '1 hour', 'queued', (random() * 2)::int, 3, target, timeout_ms, 100, 2,
            concurrency, now() - interval '10 minutes' FROM jobs`,
  );
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before, claimed_by, claim_expires_at, started_at)
     SELECT id, now(), 'running', 1, 3, target, timeout_ms, 100, 2, concurrency, now(), 'node-a',
            now() + interval '10 minutes', now() FROM jobs WHERE concurrency = 'forbid'`,
  );
  await db.pool.query('ANALYZE runs');
  let plan: Record<string, unknown> | undefined;
  const explaining = {
    query: async (text: string, values?: unknown[]) => {
      const { rows } = await db.pool.query<{ 'QUERY PLAN': [{ Plan: Record<string, unknown> }] }>(
        `EXPLAIN (ANALYZE, FORMAT JSON) ${text}`,
        values,
      );
      plan = rows[0]!['QUERY PLAN'][0].Plan;
      return { rows: [{}] };
    },
  } as unknown as Queryable;
  await readClusterCounts(explaining, 5000, 100_000);
  const read = scans(plan!);
  const total = read.reduce((sum, s) => sum + s.rows, 0);
  // Queued and overdue each read the backlog (≈ 2 × 30,000); the rest is the running runs and
  // their jobs' lookups, the outbox and the dead letters: a few thousand rows at most.
  assert.ok(total < 2 * QUEUED + 5000, `rows read: ${total}: ${JSON.stringify(read)}`);
  const counts = await readClusterCounts(db.pool, 5000, 100_000);
  const { rows } = await db.pool.query<{ waiting: number }>(
    `SELECT count(*)::int AS waiting FROM runs WHERE state = 'queued' AND concurrency = 'forbid' AND attempt > 0`,
  );
  assert.equal(counts.runsWaitingForbid, rows[0]!.waiting);
  assert.equal(counts.runsOverdue, QUEUED - rows[0]!.waiting);
});
