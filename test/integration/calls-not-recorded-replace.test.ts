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

// HeliosCallsNotRecorded (helios_stale_completions_total) means "a call's outcome was discarded and
// the run is called again". A `replace` run replaced by a newer one is called by no one again, so
// its call must not count, whether the newer run replaced it after the target's status arrived
// (the claim watch aborts it with ClaimLostError(…, outcomeWanted = false), the executor keeps the
// answer and its write finds the claim gone) or just before the call ended (no abort yet: the
// write finds the attempt recorded as replaced). Both were counted. So was a call whose job was
// deleted (its run with it) just before the call ended. Real PostgreSQL and HTTP.

let db: TestDatabase;
let server: Server;
let url: string;
const NODE = 'node-a';

before(async () => {
  db = await createTestDatabase();
  server = createServer((req, res) => {
    if (req.url === '/stream') {
      // The status at once, the body never: a call the abort cuts after its 200.
      res.writeHead(200, { 'content-length': '1000' });
      res.write('accepted, and then');
    } else {
      // The whole answer after 600 ms.
      setTimeout(() => res.end('ok'), 600);
    }
  });
  server.listen(0, '127.0.0.1');
  await new Promise((r) => server.once('listening', r));
  url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});
after(async () => {
  server.closeAllConnections();
  server.close();
  await db.drop();
});

/** Two due runs of a new `replace` job calling `path`, older first; the older claimed by NODE. */
async function replaceJob(path: string) {
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
    [JSON.stringify({ url: `${url}${path}` })],
  );
  const [older, newer] = rows;
  const options = { nodeId: NODE, graceMs: 5000, skewToleranceMs: 10 };
  const [claimed] = await claimRuns(db.pool, [{ runId: older!.id, expectedAttempt: null }], options);
  assert.ok(claimed && !claimed.startPending);
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
  /** The newer run is claimed by another node and replaces the older. */
  const replace = async () => {
    await claimRuns(db.pool, [{ runId: newer!.id, expectedAttempt: null }], { ...options, nodeId: 'node-b' });
    const { replaced } = await replaceOlderRuns(db.pool, older!.job);
    assert.deepEqual(replaced, [claimed.id]);
  };
  return { claimed, ctx, metrics, executor, replace };
}

async function stale(metrics: ReturnType<typeof createMetrics>): Promise<number> {
  return (await metrics.staleCompletions.get()).values[0]?.value ?? 0;
}

test('a replace run replaced after its 200 arrived, aborted as the claim watch does, is not a call not recorded', async () => {
  const { claimed, ctx, metrics, executor, replace } = await replaceJob('/stream');
  const cancel = new AbortController();
  const attempt = runAttempt(ctx, claimed, cancel.signal);
  await sleep(300); // the target's 200 has arrived; its body stalls
  await replace();
  // What claim-watch.ts passes for a replaced (or deleted) run: no one wants its outcome.
  cancel.abort(new ClaimLostError(`run ${claimed.id} is failed (replaced)`, false));
  await attempt;
  await executor.close();
  assert.equal(await stale(metrics), 0, 'helios_stale_completions_total counted a replaced call');
});

test('a replace run replaced just before its call ended, before any abort, is not a call not recorded', async () => {
  const { claimed, ctx, metrics, executor, replace } = await replaceJob('/slow');
  const cancel = new AbortController();
  const attempt = runAttempt(ctx, claimed, cancel.signal);
  await sleep(200); // the call is under way; it ends at 600 ms, before the watch would abort it
  await replace();
  await attempt;
  await executor.close();
  const { rows } = await db.pool.query(`SELECT state, reason FROM runs WHERE id = $1`, [claimed.id]);
  assert.deepEqual(rows[0], { state: 'failed', reason: 'replaced' });
  assert.equal(await stale(metrics), 0, 'helios_stale_completions_total counted a replaced call');
});

test('a run whose job was deleted just before its call ended, before any abort, is not a call not recorded', async () => {
  const { claimed, ctx, metrics, executor } = await replaceJob('/slow');
  const cancel = new AbortController();
  const attempt = runAttempt(ctx, claimed, cancel.signal);
  await sleep(200); // the call is under way; it ends at 600 ms, before the watch would abort it
  // What DELETE /jobs/{id} ends with (deleteJobRow): the job, and with it its runs, go.
  await db.pool.query(`DELETE FROM jobs WHERE id = (SELECT job_id FROM runs WHERE id = $1)`, [claimed.id]);
  await attempt;
  await executor.close();
  const { rows } = await db.pool.query(`SELECT 1 FROM runs WHERE id = $1`, [claimed.id]);
  assert.equal(rows.length, 0, 'the run went with its job');
  assert.equal(await stale(metrics), 0, 'helios_stale_completions_total counted a deleted run’s call');
});
