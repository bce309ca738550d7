import assert from 'node:assert/strict';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { DbClock } from '../../src/execution/db-clock.js';
import { HttpExecutor } from '../../src/execution/http-executor.js';
import { compileTargetPolicy } from '../../src/security/target-policy.js';
import { ClaimLostError } from '../../src/errors.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded } from '../../src/store/attempts.js';
import { claimRuns, replaceOlderRuns } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// A `replace` run whose target answered 200 (its body still streaming)
// when a newer run replaced it: the claim watch aborts it with ClaimLostError, and the executor
// keeps the answer (succeeded). The run stays recorded as replaced and is counted as claim-lost.

let db: TestDatabase;
let server: Server;
let url: string;
const NODE = 'node-a';

before(async () => {
  db = await createTestDatabase();
  server = createServer((_req, res) => {
    res.writeHead(200, { 'content-length': '1000' });
    res.write('accepted, and then');
  });
  server.listen(0, '127.0.0.1');
  await new Promise((r) => server.once('listening', r));
  url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/x`;
});
after(async () => {
  server.closeAllConnections();
  server.close();
  await db.drop();
});

test('a call replaced after its 200 arrived is recorded and counted as replaced, not succeeded', async () => {
  const { rows } = await db.pool.query<{ id: string; job: string }>(
    `WITH j AS (
       INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
       VALUES ('rp-' || gen_random_uuid(), '* * * * * *', $1, 10000, 3, 'replace', now() + interval '1 hour')
       RETURNING *)
     INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, now() - s * interval '1 second', 'queued', 3, j.target, 10000, 100, 2, 'replace',
            now() - s * interval '1 second'
     FROM j, generate_series(2, 1, -1) AS s
     RETURNING runs.id, runs.job_id AS job`,
    [JSON.stringify({ url })],
  );
  const [older, newer] = rows;
  const options = { nodeId: NODE, graceMs: 5000, skewToleranceMs: 10 };
  const [r1] = await claimRuns(db.pool, [{ runId: older!.id, expectedAttempt: null }], options);
  assert.ok(r1 && !r1.startPending);
  const metrics = createMetrics('test');
  const executor = new HttpExecutor({ targetPolicy: compileTargetPolicy() });
  const ctx: AttemptContext = {
    pool: db.pool,
    nodeId: NODE,
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock: new DbClock(),
    start: async () => true,
    complete: (run, report) => completeSucceeded(db.pool, run, NODE, report),
    logger: silentLogger,
    metrics,
  };
  const cancel = new AbortController();
  const attempt = runAttempt(ctx, r1, cancel.signal);
  await sleep(300); // the target's 200 has arrived; its body stalls
  // The next occurrence is claimed (by another node) and replaces r1; the claim watch aborts r1.
  await claimRuns(db.pool, [{ runId: newer!.id, expectedAttempt: null }], { ...options, nodeId: 'node-b' });
  const { replaced } = await replaceOlderRuns(db.pool, older!.job);
  assert.deepEqual(replaced, [r1.id]);
  cancel.abort(new ClaimLostError(`run ${r1.id} is now failed (replaced)`));
  await attempt;
  await executor.close();

  const executed = (await metrics.runsExecuted.get()).values.map((v) => `${v.labels.outcome}=${v.value}`);
  const stale = (await metrics.staleCompletions.get()).values[0]?.value;
  // Its completion write found the claim gone, but a replaced run is called by no one again: not a
  // call not recorded (HeliosCallsNotRecorded; calls-not-recorded-replace.test.ts). Counted 1 before.
  assert.equal(stale ?? 0, 0, 'a replaced call is not counted as a discarded outcome');
  const { rows: state } = await db.pool.query(
    `SELECT r.state, r.reason, a.outcome FROM runs r JOIN run_attempts a ON a.run_id = r.id WHERE r.id = $1`,
    [r1.id],
  );
  assert.deepEqual(state[0], { state: 'failed', reason: 'replaced', outcome: 'replaced' });
  assert.deepEqual(executed, ['claim-lost=1'], 'the replaced call counted as what it was recorded as');
});
