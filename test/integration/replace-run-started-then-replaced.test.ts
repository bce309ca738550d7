import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { createStartBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, type AttemptReport } from '../../src/store/attempts.js';
import { claimRuns, replaceOlderRuns, startRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilDbTime } from '../support/db-time.js';

// START precedes replaceOlderRuns in runAttempt. Two replace runs of one
// job: R1 (older occurrence, claimed within the skew tolerance before its time, so startPending)
// and R2 (the next occurrence). R1's START commits, but its answer comes late (START retried
// through a PostgreSQL restart, a queued batch). Meanwhile R2 falls due, is claimed, STARTed and
// replaces R1 (R1: failed/replaced, claim gone, NOTIFY sent). R1's own replaceOlderRuns then finds
// R1 no longer running, so R1 is not in its `replaced` list; R1 must still not be called (it is not
// the attempt replaceOlderRuns leaves running), where the claim watch would abort it only a round
// trip later, or at its interval while LISTEN reconnects.

let db: TestDatabase;
const A = 'node-a';
const B = 'node-b';

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

async function runState(id: string) {
  const { rows } = await db.pool.query<{ state: string; claimedBy: string | null; attempt: number }>(
    `SELECT state, claimed_by AS "claimedBy", attempt FROM runs WHERE id = $1`,
    [id],
  );
  return rows[0];
}

test('a replace run STARTed, then replaced by the next occurrence before its own replaceOlderRuns, is not called', async () => {
  const { rows: jobs } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     VALUES ('rp-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, 3, 'replace',
             now() + interval '1 hour') RETURNING id`,
  );
  const jobId = jobs[0]!.id;
  const make = async (seconds: number) => {
    const { rows } = await db.pool.query<{ id: string; scheduledFor: Date }>(
      `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                         backoff_multiplier, concurrency, not_before)
       SELECT j.id, t, 'queued', 3, j.target, 1000, 100, 2, 'replace', t
       FROM jobs j, (SELECT date_trunc('second', clock_timestamp()) + $2 * interval '1 second' AS t) s
       WHERE j.id = $1 RETURNING id, scheduled_for AS "scheduledFor"`,
      [jobId, seconds],
    );
    return rows[0]!;
  };
  const r1 = await make(2);
  const r2 = await make(3);
  // Replace runs are claimed only once due, within the skew tolerance (here 10 s, its maximum).
  const [claimed1] = await claimRuns(db.pool, [{ runId: r1.id, expectedAttempt: null }], {
    nodeId: A,
    graceMs: 5000,
    skewToleranceMs: 10_000,
  });
  assert.ok(claimed1?.startPending, 'R1 claimed before its time: startPending');
  await untilDbTime(db.pool, r1.scheduledFor);

  const calls: { run: string; stateAtCall: unknown }[] = [];
  const executor = {
    execute: async (run: ClaimedRun, cancel: AbortSignal): Promise<AttemptReport> => {
      calls.push({ run: run.id, stateAtCall: await runState(run.id) });
      if (cancel.aborted) throw new Error('unexpected: aborted');
      return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: null };
    },
  } as unknown as HttpExecutor;
  const starts = createStartBatcher(db.pool, A, 10);
  const ctx: AttemptContext = {
    pool: db.pool,
    nodeId: A,
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock: new DbClock(),
    start: async (run) => {
      const ok = await starts.add({ id: run.id, attempt: run.attempt });
      // R1's START committed; its answer arrives only after R2 has fallen due and replaced R1.
      await untilDbTime(db.pool, r2.scheduledFor);
      const [claimed2] = await claimRuns(db.pool, [{ runId: r2.id, expectedAttempt: null }], {
        nodeId: B,
        graceMs: 5000,
        skewToleranceMs: 10,
      });
      assert.ok(claimed2, 'R2 claimed by node B');
      if (claimed2.startPending) assert.deepEqual(await startRuns(db.pool, B, [claimed2]), [true]);
      assert.deepEqual((await replaceOlderRuns(db.pool, jobId)).replaced, [r1.id], 'R2 replaced R1');
      return ok;
    },
    complete: (run, report) => completeSucceeded(db.pool, run, A, report),
    logger: silentLogger,
    metrics: createMetrics('test'),
  };
  await ctx.clock.sync(db.pool);
  await runAttempt(ctx, claimed1, new AbortController().signal);
  assert.deepEqual(
    calls,
    [],
    'R1 was called although it had been replaced (its claim gone) before the call began',
  );
});
