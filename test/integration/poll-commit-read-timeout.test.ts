import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { inTransaction, isReadTimeout } from '../../src/store/db.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { jobWithQueuedRuns } from '../support/execution.js';

// A transaction whose statements wait a bounded time for their answers (inTransaction's
// readTimeoutMs), here the polling fallback's. A COMMIT whose answer comes later than that (a slow fsync, a
// synchronous standby away, a connection gone silent after the COMMIT reached the server) may
// still commit: the poll had then claimed runs that no one would call. Left so, they waited for
// their claims to expire (timeout + grace) and the reaper's re-queue counted a forgiven expiry
// against each; so COMMIT waits for its answer as long as the pool's read timeout says (35 s), and
// the claims come back to be called, or handed back uncounted when too late (claim-too-late).

let db: TestDatabase;
const NODE = 'node-poll';
const READ_TIMEOUT_MS = 400;
const COMMIT_TAKES_MS = 1200;

before(async () => {
  db = await createTestDatabase();
  // A COMMIT that takes COMMIT_TAKES_MS once, when a row of commit_stall asks for it: a deferred
  // trigger on the attempts a claim records runs at COMMIT.
  await db.pool.query(`
    CREATE TABLE commit_stall (ms int NOT NULL);
    CREATE FUNCTION stall_commit() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE wait_ms int;
    BEGIN
      DELETE FROM commit_stall RETURNING ms INTO wait_ms;
      IF wait_ms IS NOT NULL THEN PERFORM pg_sleep(wait_ms / 1000.0); END IF;
      RETURN NULL;
    END $$;
    CREATE CONSTRAINT TRIGGER stall_commit AFTER INSERT ON run_attempts
      DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION stall_commit();`);
});
after(() => db.drop());

test("a poll whose COMMIT is answered after its statements' read timeout gets its claims: none is left claimed with no one to call it", async () => {
  const { runs } = await jobWithQueuedRuns(db.pool, {
    name: 'slow-commit',
    schedule: '* * * * * *',
    concurrency: 'allow',
    dueAt: ["clock_timestamp() - interval '3 seconds'"],
  });
  const id = runs[0]!;
  await db.pool.query('INSERT INTO commit_stall VALUES ($1)', [COMMIT_TAKES_MS]);
  const began = Date.now();
  const polled = await inTransaction(
    db.pool,
    (client) => claimOverdueRuns(client, 1000, 10, { nodeId: NODE, graceMs: 200, skewToleranceMs: 10 }),
    { readTimeoutMs: READ_TIMEOUT_MS },
  ).catch((err: unknown) => (isReadTimeout(err) ? 'read timeout' : Promise.reject(err)));
  // The COMMIT has ended on the server (it commits: nothing tells it that a client left).
  await sleep(Math.max(0, COMMIT_TAKES_MS + 300 - (Date.now() - began)));
  const { rows } = await db.pool.query(
    `SELECT state, claimed_by AS "claimedBy", (SELECT count(*)::int FROM commit_stall) AS stalls
     FROM runs WHERE id = $1`,
    [id],
  );
  assert.deepEqual(rows[0], { state: 'running', claimedBy: NODE, stalls: 0 }, 'the poll committed');
  assert.deepEqual(
    typeof polled === 'string' ? polled : polled.claimed.map((run) => run.id),
    [id],
    'the poll returned the run it claimed',
  );
});
