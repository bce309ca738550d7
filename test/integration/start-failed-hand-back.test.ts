import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { pino } from 'pino';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { createStartBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, type AttemptReport } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { pauseJob } from '../../src/jobs/commands.js';
import { forgiveExpiredClaims } from '../../src/store/releases.js';
import { claimRuns, startRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilDbTime } from '../support/db-time.js';
import { jobWithQueuedRuns } from '../support/execution.js';

// A run claimed ahead of its time is marked started (START) right before its call; a START that
// cannot be written (PostgreSQL away, a pool timeout) is retried while the claim covers the call,
// then the claim is handed back (attempt.ts startWhenDue, start-failed): re-queued and announced
// without using up an attempt, rather than held until the reaper takes it. A trigger makes START's
// update fail for real, as PostgreSQL reports a server starting up, for an armed job's runs.

let db: TestDatabase;
const A = 'node-a';
const B = 'node-b';
const SKEW_MS = 10;

before(async () => {
  db = await createTestDatabase();
  await db.pool.query(`
    CREATE TABLE start_fault (job_id uuid PRIMARY KEY, releases boolean NOT NULL);
    CREATE FUNCTION start_fault() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF EXISTS (SELECT 1 FROM start_fault f WHERE f.job_id = NEW.job_id
                 AND (NEW.state = 'running' OR f.releases)) THEN
        RAISE EXCEPTION 'the database system is starting up (a test''s fault)' USING ERRCODE = '57P03';
      END IF;
      RETURN NEW;
    END $$;
    -- START (running, started_at set) and, when asked, the release (running to queued).
    CREATE TRIGGER start_fault BEFORE UPDATE ON runs FOR EACH ROW
      WHEN (OLD.state = 'running'
            AND (NEW.state = 'queued' OR NEW.state = 'running' AND NEW.started_at IS NOT NULL))
      EXECUTE FUNCTION start_fault();`);
});
after(() => db.drop());

/** Makes START of job `job`'s runs fail (and their release too, with `releases`) until healed. */
const failStarts = (job: string, releases = false) =>
  db.pool.query('INSERT INTO start_fault VALUES ($1, $2)', [job, releases]);
const heal = (job: string) => db.pool.query('DELETE FROM start_fault WHERE job_id = $1', [job]);

/** A job with one run due 300 ms from now (1 s timeout), claimed ahead by node A (1 s grace). */
async function claimedAhead(): Promise<{ job: string; run: ClaimedRun }> {
  const { job, runs } = await jobWithQueuedRuns(db.pool, {
    name: 'sf',
    schedule: '* * * * * *',
    concurrency: 'allow',
    dueAt: ["clock_timestamp() + interval '300 milliseconds'"],
  });
  const [run] = await claimRuns(db.pool, [{ runId: runs[0]!, expectedAttempt: null }], {
    nodeId: A,
    graceMs: 1000,
    skewToleranceMs: SKEW_MS,
    leadMs: 60_000,
  });
  assert.ok(run?.startPending, 'claimed ahead');
  return { job, run };
}

/**
 * A worker on `nodeId` (the real START batcher, `skewMs` its clock skew tolerance) whose calls are
 * appended to `calls`, its warnings' messages to `warned`.
 */
function worker(nodeId: string, calls: string[], warned: string[] = [], skewMs = SKEW_MS): AttemptContext {
  const starts = createStartBatcher(db.pool, nodeId, skewMs);
  const executor = {
    execute: async (run: ClaimedRun): Promise<AttemptReport> => {
      calls.push(`${nodeId}:${run.attempt}`);
      return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: null };
    },
  } as unknown as HttpExecutor;
  return {
    pool: db.pool,
    nodeId,
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock: new DbClock(),
    start: (run) => starts.add({ id: run.id, attempt: run.attempt }),
    complete: (run, report) => completeSucceeded(db.pool, run, nodeId, report),
    logger: pino(
      { level: 'warn' },
      { write: (line: string) => warned.push((JSON.parse(line) as { msg: string }).msg) },
    ),
    metrics: createMetrics('test'),
  };
}

/** Runs node A's attempt at the run's time, as its run queue would. */
async function attemptAtItsTime(ctx: AttemptContext, run: ClaimedRun): Promise<void> {
  await ctx.clock.sync(db.pool);
  await untilDbTime(db.pool, run.notBefore);
  await runAttempt(ctx, run, new AbortController().signal);
}

async function stateOf(id: string) {
  const { rows } = await db.pool.query(
    `SELECT r.state, r.claimed_by, r.attempt, r.max_attempts - r.attempt AS attempts_left,
            r.started_at IS NOT NULL AS started, a.outcome,
            (SELECT count(*)::int FROM outbox o WHERE o.payload->>'runId' = r.id::text) AS announced
     FROM runs r JOIN run_attempts a ON a.run_id = r.id AND a.attempt = r.attempt WHERE r.id = $1`,
    [id],
  );
  return rows[0];
}

const outcomes = async (ctx: AttemptContext) =>
  (await ctx.metrics.runsExecuted.get()).values.map((v) => `${v.labels.outcome}=${v.value}`);

/** Node B claims the handed-back run (due: its claim starts it) and calls it. */
async function claimedAgainAndCalled(id: string, calls: string[]): Promise<void> {
  const [again] = await claimRuns(db.pool, [{ runId: id, expectedAttempt: 2 }], {
    nodeId: B,
    graceMs: 1000,
    skewToleranceMs: SKEW_MS,
  });
  assert.ok(again && !again.startPending, 'claimed again, started by its claim');
  const b = worker(B, calls);
  await b.clock.sync(db.pool);
  await runAttempt(b, again, new AbortController().signal);
}

for (const committed of [false, true]) {
  test(`a START that keeps failing${committed ? ' (one committed, its answer lost)' : ''} hands the claim back before it expires, uncalled and without using an attempt; called once after`, async () => {
    const { job, run } = await claimedAhead();
    // Committed but its answer lost: the run is marked started, then every try the worker sees fails.
    if (committed) {
      await untilDbTime(db.pool, run.notBefore);
      assert.deepEqual(await startRuns(db.pool, A, [run], SKEW_MS), [true]);
    }
    await failStarts(job);
    const calls: string[] = [];
    const warned: string[] = [];
    const a = worker(A, calls, warned);
    await attemptAtItsTime(a, run);
    // Left to the reaper, it stayed running, claimed by A, until its claim expired (≈2 s after its
    // time; an hour for the longest timeouts).
    assert.ok(Date.now() < run.claimExpiresAt.getTime(), 'handed back before its claim expired');
    assert.deepEqual(calls, []);
    assert.deepEqual(await stateOf(run.id), {
      state: 'queued',
      claimed_by: null,
      attempt: 1,
      attempts_left: 3,
      // A run marked started keeps started_at: it is due (attempt.ts startWhenDue).
      started: committed,
      outcome: 'cancelled',
      announced: 1,
    });
    assert.deepEqual(await outcomes(a), ['start-failed=1']);
    assert.equal(
      warned.at(-1),
      'call not made: the run could not be marked started while the claim covered the call; claim handed back',
    );
    await heal(job);
    await claimedAgainAndCalled(run.id, calls);
    assert.deepEqual(calls, [`${B}:2`], 'called once, by the next claim');
    assert.equal((await stateOf(run.id))!.state, 'succeeded');
  });
}

test('a START that keeps failing while the hand-back cannot be written either leaves the run to the reaper, uncalled; called once after', async () => {
  const { job, run } = await claimedAhead();
  await failStarts(job, true);
  const calls: string[] = [];
  const warned: string[] = [];
  const a = worker(A, calls, warned);
  await attemptAtItsTime(a, run);
  assert.deepEqual(calls, []);
  // Still A's claim, not started: the reaper re-queues it (claimOver), without charging an attempt.
  assert.deepEqual(await stateOf(run.id), {
    state: 'running',
    claimed_by: A,
    attempt: 1,
    attempts_left: 2,
    started: false,
    outcome: null,
    announced: 0,
  });
  assert.deepEqual(await outcomes(a), ['start-failed=1']);
  assert.equal(
    warned.at(-1),
    'call not made: the run could not be marked started while the claim covered the call; the claim could not be handed back: the reaper re-queues the run once it expires',
  );
  await heal(job);
  await untilDbTime(db.pool, run.claimExpiresAt.getTime() + 5);
  const forgiven = await inTransaction(db.pool, (c) =>
    forgiveExpiredClaims(c, [{ run, error: 'claim expired' }], 2, 'runs'),
  );
  assert.ok(forgiven[0], 'the reaper re-queued it');
  await claimedAgainAndCalled(run.id, calls);
  assert.deepEqual(calls, [`${B}:2`], 'called once, by the next claim');
});

// `replace`: a run handed back marked started (its START committed, the answer lost) counts as
// started for the job's older runs (runs.ts REPLACE_OLDER: started_at set), before it is called. An
// older run claimed meanwhile is replaced uncalled; the newer one must then still be called, once,
// and without START, whatever a pause does in between. START marks a run up to the skew tolerance
// before its time (a worker whose estimate of the database clock runs early), so it may be handed
// back, marked, still ahead of its time: a pause then must keep it (jobs.ts WITHDRAW_FUTURE_RUNS
// takes only runs not started). Handed back after its time, as it used to be here, the run is no
// future run for a pause to withdraw, whatever the pause checks: that step could not fail.
test('replace: a run handed back marked started (a lost START) before its time replaces an older run claimed meanwhile; a pause keeps it, and it is called once', async () => {
  const skewMs = 3000;
  const { job, runs } = await jobWithQueuedRuns(db.pool, {
    name: 'sfr',
    schedule: '* * * * * *',
    concurrency: 'replace',
    dueAt: ["clock_timestamp() - interval '10 seconds'", "clock_timestamp() + interval '2400 milliseconds'"],
  });
  const [older, newer] = [runs[0]!, runs[1]!];
  // Node A (a 3 s skew tolerance, a 100 ms grace) claims the newer run 2.4 s before its time (a
  // replace run is claimed only within the tolerance), its START commits at once and the answer
  // is lost, then every START fails.
  const [run] = await claimRuns(db.pool, [{ runId: newer, expectedAttempt: null }], {
    nodeId: A,
    graceMs: 100,
    skewToleranceMs: skewMs,
  });
  assert.ok(run?.startPending, 'claimed ahead');
  assert.deepEqual(await startRuns(db.pool, A, [run], skewMs), [true]);
  await failStarts(job);
  const calls: string[] = [];
  // START is retried while a call could still end within the claim (its time + the grace), then
  // the claim is handed back: ≈1.6 s on, ≈800 ms before the run's time.
  const a = worker(A, calls, [], skewMs);
  await a.clock.sync(db.pool);
  await runAttempt(a, run, new AbortController().signal);
  assert.deepEqual(calls, []);
  assert.deepEqual(await stateOf(newer), {
    state: 'queued',
    claimed_by: null,
    attempt: 1,
    attempts_left: 3,
    started: true,
    outcome: 'cancelled',
    announced: 1,
  });
  await heal(job);
  // A pause before the run's time: it was started, so it is not withdrawn.
  await pauseJob(db.pool, { id: job }, { runsTopic: 'runs', misfireThresholdMs: 5000 });
  const { rows: kept } = await db.pool.query<{ ahead: boolean }>(
    'SELECT scheduled_for > clock_timestamp() AS ahead FROM runs WHERE id = $1',
    [newer],
  );
  assert.deepEqual(kept, [{ ahead: true }], 'kept by a pause that came before its time');
  // The older run is claimed (its announcement was late): replaced by the newer, uncalled.
  const [first] = await claimRuns(db.pool, [{ runId: older, expectedAttempt: null }], {
    nodeId: B,
    graceMs: 1000,
    skewToleranceMs: SKEW_MS,
  });
  assert.ok(first && !first.startPending);
  const b = worker(B, calls);
  await b.clock.sync(db.pool);
  await runAttempt(b, first, new AbortController().signal);
  assert.deepEqual(calls, [], 'the older run is not called once a run asked for later has started');
  await untilDbTime(db.pool, run.notBefore);
  await claimedAgainAndCalled(newer, calls);
  assert.deepEqual(calls, [`${B}:2`], 'the newer run is called once, by its next claim');
  const { rows: states } = await db.pool.query(
    'SELECT id, state, reason FROM runs WHERE job_id = $1 ORDER BY scheduled_for',
    [job],
  );
  assert.deepEqual(states, [
    { id: older, state: 'failed', reason: 'replaced' },
    { id: newer, state: 'succeeded', reason: null },
  ]);
});
