import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type { Queryable } from '../../src/store/db.js';
import { replaceOlderRuns } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// A `replace` run's replacement (runs.ts REPLACE_OLDER) runs at every start of such a run, on a job
// that may keep tens of thousands of finished runs (an every-minute job over the 30-day retention:
// 43,200). Its plan must stay cheap by the planner's own estimate: past jit_above_cost (100,000 by
// default) PostgreSQL JIT-compiles the statement on each call, ≈60 ms where it runs in ≈1 ms.

let db: TestDatabase;

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

test("a replace run's replacement on a job with 40,000 finished runs is planned below jit_above_cost", async () => {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     VALUES ('rp-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3, 'replace',
             now() + interval '1 hour') RETURNING id`,
  );
  const job = rows[0]!.id;
  // 40,000 finished occurrences, one a minute, and the latest one running (started).
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before, started_at, finished_at, claimed_by)
     SELECT $1, t, CASE WHEN s = 1 THEN 'running' ELSE 'succeeded' END, 1, 3, '{}', 1000, 0, 2, 'replace',
            t, t, CASE WHEN s > 1 THEN t END, CASE WHEN s = 1 THEN 'node-a' END
     FROM generate_series(1, 40000) s, LATERAL (SELECT date_trunc('minute', now()) - s * interval '1 minute' AS t) x`,
    [job],
  );
  await db.pool.query('ANALYZE runs');
  let cost: number | undefined;
  const explaining: Queryable = {
    query: async (text: unknown, values?: unknown[]) => {
      const sql = typeof text === 'string' ? text : (text as { text: string }).text;
      const { rows: plan } = await db.pool.query<{ 'QUERY PLAN': [{ Plan: { 'Total Cost': number } }] }>(
        `EXPLAIN (FORMAT JSON) ${sql}`,
        values,
      );
      cost = plan[0]!['QUERY PLAN'][0].Plan['Total Cost'];
      return { rows: [] };
    },
  } as unknown as Queryable;
  await replaceOlderRuns(explaining, job);
  const { rows: setting } = await db.pool.query<{ jit: string }>(
    `SELECT current_setting('jit_above_cost') AS jit`,
  );
  assert.ok(
    cost !== undefined && cost < Number(setting[0]!.jit),
    `estimated cost ${cost}, jit_above_cost ${setting[0]!.jit}`,
  );
  // Still right: the latest occurrence is the one left running.
  assert.equal((await replaceOlderRuns(db.pool, job)).running?.nodeId, 'node-a');
});
