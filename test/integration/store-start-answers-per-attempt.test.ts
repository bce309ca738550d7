import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { releaseClaim } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { claimRuns, startRuns, type ClaimOptions } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// startRuns answers per (run id, attempt), as completeSucceededMany does: a batch holding a stale
// attempt and the current attempt of the same run (same node) starts only the current one. (Not
// reachable through the RunQueue today: a second startPending attempt of a run on the same node
// needs the first handed back unstarted before its time, which only a stopping worker does, and it
// claims nothing afterwards.)

let db: TestDatabase;
const NODE = 'node-a';
const ahead: ClaimOptions = { nodeId: NODE, graceMs: 5000, skewToleranceMs: 10, leadMs: 600_000 };

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

test('a START batch with a stale and the current attempt of one run answers each attempt on its own', async () => {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     VALUES ('sa-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3, 'allow',
             now() + interval '1 hour') RETURNING id`,
  );
  const { rows: runs } = await db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, t, 'queued', 3, j.target, 1000, 100, 2, 'allow', t
     FROM jobs j, (SELECT date_trunc('second', now()) + interval '30 seconds' AS t) s
     WHERE j.id = $1 RETURNING id`,
    [rows[0]!.id],
  );
  const id = runs[0]!.id;
  const [first] = await claimRuns(db.pool, [{ runId: id, expectedAttempt: null }], ahead);
  assert.ok(first?.startPending);
  const report = {
    outcome: 'cancelled' as const,
    statusCode: null,
    durationMs: null,
    error: 'stopping',
    responseExcerpt: null,
  };
  assert.ok(await inTransaction(db.pool, (c) => releaseClaim(c, first, NODE, report, 'runs')));
  const [second] = await claimRuns(db.pool, [{ runId: id, expectedAttempt: 2 }], ahead);
  assert.ok(second?.startPending);
  assert.deepEqual(
    await startRuns(db.pool, NODE, [first, second]),
    [false, true],
    'the stale attempt 1 must not be told it may call',
  );
});
