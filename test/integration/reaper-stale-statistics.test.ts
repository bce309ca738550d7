import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { selectExpiredRuns } from '../../src/store/attempts.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { capturedStatement, holdStatistics, loopsOfScan } from '../support/plans.js';

// The reaper's statement (selectExpiredRuns) runs inside a fenced transaction: while it runs, the
// fence row is locked and no dispatch pass can commit. In a herd benchmark an autovacuum analyze
// of `runs` landed between the herd's dispatch and its claims, so the statistics said every run
// was queued; the planner then estimated one running run and ran the never-started candidates'
// subquery again for each running run it scanned. With 8,000 runs claimed ahead the statement
// took 12 s (21 s under the herd's load), and the next herd was dispatched 7–9 s after it was due.
// Here the same statistics are made on purpose, and the statement must scan the candidates once.

const QUEUED = 5000;
const CLAIMED_AHEAD = 2000;
const NEVER_STARTED = 20;
const GRACE_MS = 5000;

let db: TestDatabase;

before(async () => {
  db = await createTestDatabase();
  await holdStatistics(db.pool, 'runs');
  await db.pool.query(
    `INSERT INTO jobs (name, schedule, target, next_run_at)
     SELECT 'stale-' || n, '0 0 0 * * *', '{"url": "http://127.0.0.1:9/"}', now() + interval '1 day'
     FROM generate_series(1, $1::int) AS n`,
    [QUEUED],
  );
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before)
     SELECT id, now() + interval '1 second', 'queued', 3, target, 5000, 1000, 2, now() + interval '1 second'
     FROM jobs`,
  );
  // Statistics taken while every run was queued, as after a herd's dispatch.
  await db.pool.query('ANALYZE runs');
  await db.pool.query('ANALYZE jobs');
  // Then the herd's claims ahead: running, not started, due in a second, the claim good for 10 s...
  await db.pool.query(
    `UPDATE runs SET state = 'running', attempt = 1, claimed_by = 'worker-a',
                     claim_expires_at = now() + interval '10 seconds'
     WHERE id IN (SELECT id FROM runs ORDER BY id LIMIT $1)`,
    [CLAIMED_AHEAD],
  );
  // ...of which a few were never started, their grace over: what the statement is for.
  await db.pool.query(
    `UPDATE runs SET not_before = now() - interval '10 seconds'
     WHERE id IN (SELECT id FROM runs WHERE state = 'running' ORDER BY id LIMIT $1)`,
    [NEVER_STARTED],
  );
});
after(() => db.drop());

/** The statement selectExpiredRuns sends, and its parameters (captured, not run). */
const reaperStatement = () =>
  capturedStatement((capture) =>
    selectExpiredRuns(capture, 100, { unstartedAfterMs: GRACE_MS, unstartedLimit: 1000 }),
  );

test('the statistics say every run is queued while thousands are claimed ahead', async () => {
  const { rows } = await db.pool.query<{ values: string }>(
    `SELECT most_common_vals::text AS values FROM pg_stats WHERE tablename = 'runs' AND attname = 'state'`,
  );
  assert.equal(rows[0]?.values, '{queued}');
});

test('the reaper scans the never-started candidates once, whatever the statistics, and finds them', async () => {
  const { sql, params } = await reaperStatement();
  assert.deepEqual(await loopsOfScan(db.pool, sql, params, 'c'), [1]);
  const expired = await selectExpiredRuns(db.pool, 100, { unstartedAfterMs: GRACE_MS, unstartedLimit: 1000 });
  assert.equal(expired.length, NEVER_STARTED);
  assert.ok(expired.every((run) => run.unstarted));
});

test('written as `r.id IN (subquery)`, as before, the same statement scans them once per claimed run', async () => {
  // The control: the form this statement had until 2026-12-06, on the same statistics. If the
  // planner stopped choosing the nested loop here, the test above would show nothing.
  const { sql, params } = await reaperStatement();
  const asBefore = sql
    .replace('WHERE r.id = ANY (ARRAY(', 'WHERE r.id IN (')
    .replace('LIMIT $3))', 'LIMIT $3)');
  assert.notEqual(asBefore, sql, 'the statement no longer has the form this control rewrites');
  const loops = await loopsOfScan(db.pool, asBefore, params, 'c');
  assert.ok(
    loops.some((n) => n >= CLAIMED_AHEAD),
    `the candidates' scan ran ${loops.join(', ')} times, not once per claimed run`,
  );
});
