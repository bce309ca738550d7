import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { createFailureBatcher, createReleaseBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import { FORGIVEN_EXPIRIES } from '../../src/execution/reaper.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, failAttempt, type AttemptReport } from '../../src/store/attempts.js';
import { inTransaction, type Queryable } from '../../src/store/db.js';
import { buryRun, replayDeadLetter } from '../../src/store/dead-letters.js';
import { pauseJob } from '../../src/jobs/commands.js';
import { claimRuns, startRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { jobWithQueuedRuns, queuedRuns, untilWaitingForLocks } from '../support/execution.js';

// `replace`: once a run asked for later has started, an older run of the job is not called
// (runs.ts REPLACE_OLDER). The newer run's replacement takes the older queued runs FOR UPDATE SKIP
// LOCKED, and a running one whose row another transaction holds it re-reads once that commits: an
// older run whose row another worker held at that moment (its claim in an open transaction, or its
// failed attempt's settle turning it back to queued for a retry) is left. Its own claim's
// replacement must then still find the newer run, even once that run's call has ended.

let db: TestDatabase;
const A = 'node-a';
const B = 'node-b';
const TOPICS = { runsTopic: 'runs', deadLetterTopic: 'dead' };
const OPTIONS = { graceMs: 5000, skewToleranceMs: 10 };
const OK: AttemptReport = {
  outcome: 'succeeded',
  statusCode: 200,
  durationMs: 1,
  error: null,
  responseExcerpt: null,
};
const FAILED: AttemptReport = {
  outcome: 'failed',
  statusCode: 500,
  durationMs: 1,
  error: 'HTTP 500',
  responseExcerpt: null,
};

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** A `replace` job with two due occurrences, 20 s and 10 s ago. */
async function olderAndNewer(): Promise<{ job: string; older: string; newer: string }> {
  const {
    job,
    runs: [older, newer],
  } = await jobWithQueuedRuns(db.pool, {
    name: 'rl',
    schedule: '*/10 * * * * *',
    concurrency: 'replace',
    dueAt: [
      "date_trunc('second', now()) - interval '20 seconds'",
      "date_trunc('second', now()) - interval '10 seconds'",
    ],
  });
  return { job, older: older!, newer: newer! };
}

/**
 * A worker on `nodeId` whose calls are appended to `calls` and answered with success, once `held`
 * (if given) resolves.
 */
function worker(nodeId: string, calls: string[], held?: Promise<void>): AttemptContext {
  const executor = {
    execute: async (run: ClaimedRun): Promise<AttemptReport> => {
      calls.push(run.id);
      await held;
      return OK;
    },
  } as unknown as HttpExecutor;
  return {
    pool: db.pool,
    nodeId,
    executor,
    topics: TOPICS,
    clock: new DbClock(),
    start: async () => true,
    complete: (run, r) => completeSucceeded(db.pool, run, nodeId, r),
    logger: silentLogger,
    metrics: createMetrics('test'),
  };
}

async function claim(nodeId: string, runId: string, on: Queryable = db.pool) {
  const [run] = await claimRuns(on, [{ runId, expectedAttempt: null }], { nodeId, ...OPTIONS });
  assert.ok(run && !run.startPending, `run ${runId} claimed by ${nodeId}`);
  return run;
}

async function stateOf(id: string) {
  const { rows } = await db.pool.query<{ state: string; reason: string | null }>(
    'SELECT state, reason FROM runs WHERE id = $1',
    [id],
  );
  return rows[0];
}

test('an older run whose claim held its row while the newer run started is not called after it', async () => {
  const { older, newer } = await olderAndNewer();
  const calls: string[] = [];
  // Node A's claim of the older run, uncommitted (a batch or the polling fallback's transaction).
  const holder = await db.pool.connect();
  try {
    await holder.query('BEGIN');
    const olderRun = await claim(A, older, holder);
    // Node B claims the newer run, replaces (its replacement skips the locked older row), calls it.
    const b = worker(B, calls);
    await runAttempt(b, await claim(B, newer), new AbortController().signal);
    assert.deepEqual(calls, [newer]);
    await holder.query('COMMIT');
    await runAttempt(worker(A, calls), olderRun, new AbortController().signal);
  } finally {
    await holder.query('ROLLBACK').catch(() => undefined);
    holder.release();
  }
  assert.deepEqual(calls, [newer], 'the older occurrence was called after the newer one had started');
  assert.deepEqual(await stateOf(older), { state: 'failed', reason: 'replaced' });
  assert.equal((await stateOf(newer))!.state, 'succeeded');
});

test("an older run whose failed attempt's settle held its row while the newer run started does not retry after it", async () => {
  const { older, newer } = await olderAndNewer();
  const calls: string[] = [];
  const first = await claim(A, older);
  // Node A settles the older run's failed first attempt (a retry, due at once): uncommitted.
  const holder = await db.pool.connect();
  let newerAttempt: Promise<void> | undefined;
  try {
    await holder.query('BEGIN');
    assert.equal((await failAttempt(holder, first, { nodeId: A }, FAILED, 0, TOPICS))?.state, 'queued');
    // Node B's newer run replaces: it waits for the older run's row (running when it looked).
    newerAttempt = runAttempt(worker(B, calls), await claim(B, newer), new AbortController().signal);
    await untilWaitingForLocks(db.pool, { timeoutMs: 2_000, everyMs: 10 });
    await holder.query('COMMIT');
  } finally {
    await holder.query('ROLLBACK').catch(() => undefined);
    holder.release();
  }
  await newerAttempt;
  assert.deepEqual(calls, [newer]);
  // The older run's retry, claimed once the newer run's call has ended.
  const { rows } = await db.pool.query<{ state: string }>('SELECT state FROM runs WHERE id = $1', [older]);
  if (rows[0]!.state === 'queued') {
    await runAttempt(worker(A, calls), await claim(A, older), new AbortController().signal);
  }
  assert.deepEqual(calls, [newer], "the older occurrence's retry was called after the newer one had started");
  assert.deepEqual(await stateOf(older), { state: 'failed', reason: 'replaced' });
});

test('an occurrence whose claim held its row while an older run replayed since started is not called after it', async () => {
  // The older occurrence went dead and is replayed: asked for now, after the newer occurrence.
  const { job, older: replayed, newer: held } = await olderAndNewer();
  const letter = await inTransaction(db.pool, async (client) => {
    const { rows } = await client.query<{ scheduledFor: Date }>(
      `UPDATE runs SET state = 'dead', attempt = 1, started_at = scheduled_for, finished_at = now()
       WHERE id = $1 RETURNING scheduled_for AS "scheduledFor"`,
      [replayed],
    );
    const run = { id: replayed, jobId: job, attempt: 1, scheduledFor: rows[0]!.scheduledFor };
    return buryRun(client, run, { error: 'HTTP 500', statusCode: 500 }, TOPICS);
  });
  assert.ok(await replayDeadLetter(db.pool, letter, TOPICS));
  const calls: string[] = [];
  const holder = await db.pool.connect();
  try {
    await holder.query('BEGIN');
    const heldRun = await claim(A, held, holder);
    await runAttempt(worker(B, calls), await claim(B, replayed), new AbortController().signal);
    assert.deepEqual(calls, [replayed]);
    await holder.query('COMMIT');
    await runAttempt(worker(A, calls), heldRun, new AbortController().signal);
  } finally {
    await holder.query('ROLLBACK').catch(() => undefined);
    holder.release();
  }
  assert.deepEqual(
    calls,
    [replayed],
    'an occurrence asked for before the replay was called after it had started',
  );
  assert.deepEqual(await stateOf(held), { state: 'failed', reason: 'replaced' });
});

test('the reverse: a newer run whose claim held its row while the older one was called replaces it', async () => {
  const { older, newer } = await olderAndNewer();
  const calls: string[] = [];
  const holder = await db.pool.connect();
  let olderCall: Promise<void> | undefined;
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  try {
    await holder.query('BEGIN');
    const newerRun = await claim(B, newer, holder);
    // The older run is claimed and called (nothing newer runs yet); its call stays open.
    olderCall = runAttempt(worker(A, calls, released), await claim(A, older), new AbortController().signal);
    while (calls.length === 0) await sleep(5);
    await holder.query('COMMIT');
    await runAttempt(worker(B, calls), newerRun, new AbortController().signal);
  } finally {
    await holder.query('ROLLBACK').catch(() => undefined);
    holder.release();
    release();
    await olderCall;
  }
  assert.deepEqual(calls, [older, newer]);
  assert.deepEqual(await stateOf(older), { state: 'failed', reason: 'replaced' });
  assert.equal((await stateOf(newer))!.state, 'succeeded');
});

/**
 * The older of olderAndNewer's runs claimed and attempted on node A while a newer run, due in 5 s,
 * is claimed by node B within the skew tolerance (here 10 s, its maximum) before its time: not
 * started (started_at NULL) until its START, and until then a pause or an edit may withdraw it.
 */
async function olderAttemptedBesideUnstarted(calls: string[]) {
  const { job, older } = await olderAndNewer();
  const [aheadId] = await queuedRuns(db.pool, job, ["now() + interval '5 seconds'"]);
  const [ahead] = await claimRuns(db.pool, [{ runId: aheadId!, expectedAttempt: null }], {
    nodeId: B,
    ...OPTIONS,
    skewToleranceMs: 10_000,
  });
  assert.equal(ahead?.startPending, true);
  await runAttempt(worker(A, calls), await claim(A, older), new AbortController().signal);
  // START without a due check: the test need not wait for the newer run's time.
  const b = {
    ...worker(B, calls),
    start: async (run: ClaimedRun) => (await startRuns(db.pool, B, [run]))[0]!,
  };
  return { job, older, ahead: ahead!, b };
}

test('a newer run claimed ahead, not yet started, does not replace an older one: a pause then withdraws it', async () => {
  const calls: string[] = [];
  const { job, older, ahead, b } = await olderAttemptedBesideUnstarted(calls);
  // The job is paused before the newer run's time: it is withdrawn, and its START finds nothing.
  await pauseJob(db.pool, { id: job }, { runsTopic: 'runs', misfireThresholdMs: 5000 });
  await runAttempt(b, ahead, new AbortController().signal);
  assert.deepEqual(calls, [older], 'the older occurrence, due while the job was enabled, was not called');
  assert.equal((await stateOf(older))!.state, 'succeeded');
});

test("a newer run claimed ahead, not yet started, is not replaced by an older one's replacement", async () => {
  const calls: string[] = [];
  const { older, ahead, b } = await olderAttemptedBesideUnstarted(calls);
  await runAttempt(b, ahead, new AbortController().signal);
  assert.deepEqual(calls, [older, ahead.id]);
  assert.equal((await stateOf(ahead.id))!.state, 'succeeded');
});

// The replacement itself may fail (a deadlock, a serialization failure, PostgreSQL restarting): a
// trigger makes it fail for real, as PostgreSQL reports a deadlock, on its update of an older run of
// an armed job. Counted by a sequence: a failed statement rolls back any table it wrote.
const REPLACE_FAULT = `
  CREATE TABLE IF NOT EXISTS replace_fault (job_id uuid PRIMARY KEY, fail_until bigint NOT NULL);
  CREATE SEQUENCE IF NOT EXISTS replace_fault_tries;
  CREATE OR REPLACE FUNCTION replace_fault() RETURNS trigger LANGUAGE plpgsql AS $$
  DECLARE fail_until bigint;
  BEGIN
    SELECT f.fail_until INTO fail_until FROM replace_fault f WHERE f.job_id = NEW.job_id;
    IF fail_until IS NOT NULL AND nextval('replace_fault_tries') <= fail_until THEN
      RAISE EXCEPTION 'deadlock detected (a test''s fault)' USING ERRCODE = '40P01';
    END IF;
    RETURN NEW;
  END $$;
  CREATE OR REPLACE TRIGGER replace_fault BEFORE UPDATE ON runs
    FOR EACH ROW WHEN (NEW.reason = 'replaced') EXECUTE FUNCTION replace_fault();`;

/** Makes the next `failures` replacements of job `job`'s older runs fail with a deadlock. */
async function failReplacements(job: string, failures: number) {
  await db.pool.query(REPLACE_FAULT);
  await db.pool.query(
    `INSERT INTO replace_fault SELECT $1, nextval('replace_fault_tries') + $2
     ON CONFLICT (job_id) DO UPDATE SET fail_until = excluded.fail_until`,
    [job, failures],
  );
}

test("a replacement that fails once is retried: the run is called at once, not after its claim's expiry", async () => {
  const { job, older, newer } = await olderAndNewer();
  await failReplacements(job, 1);
  const calls: string[] = [];
  const begun = Date.now();
  await runAttempt(worker(B, calls), await claim(B, newer), new AbortController().signal);
  assert.deepEqual(calls, [newer], 'the run was not called after its replacement failed once');
  // Its claim lasts 6 s (a 1 s timeout, a 5 s grace): left to the reaper, it ran after that.
  assert.ok(Date.now() - begun < 3000, `called after ${Date.now() - begun} ms`);
  assert.deepEqual(await stateOf(older), { state: 'failed', reason: 'replaced' });
  assert.equal((await stateOf(newer))!.state, 'succeeded');
});

test('a replacement that keeps failing hands the claim back, uncalled and without using an attempt', async () => {
  const { job, newer } = await olderAndNewer();
  await failReplacements(job, 1_000_000);
  const calls: string[] = [];
  // A 1 s grace: the replacement is retried while a call could still end within the claim (≈1 s).
  const [run] = await claimRuns(db.pool, [{ runId: newer, expectedAttempt: null }], {
    nodeId: B,
    ...OPTIONS,
    graceMs: 1000,
  });
  const b = worker(B, calls);
  await runAttempt(b, run!, new AbortController().signal);
  assert.deepEqual(calls, []);
  const { rows } = await db.pool.query(
    `SELECT r.state, r.claimed_by, r.attempt, r.max_attempts, a.outcome
     FROM runs r JOIN run_attempts a ON a.run_id = r.id AND a.attempt = r.attempt WHERE r.id = $1`,
    [newer],
  );
  assert.deepEqual(rows[0], {
    state: 'queued',
    claimed_by: null,
    attempt: 1,
    max_attempts: 4,
    outcome: 'cancelled',
  });
  const executed = (await b.metrics.runsExecuted.get()).values.map((v) => `${v.labels.outcome}=${v.value}`);
  assert.deepEqual(executed, ['replace-failed=1']);
});

// A replacement that fails every time (a lock held on an older run past the statement timeout, a
// plan gone bad, a fault): each claim retried it while the claim covered the call, then handed the
// claim back, re-queued and announced without using an attempt, and the next claim did the same,
// for ever (one cycle per claim grace: 5 s by default, an outbox row, a message, an attempt's row
// and two warnings each; every later occurrence of the job joined the loop). Counted with the
// reaper's forgiven expiries: past FORGIVEN_EXPIRIES, a hand-back is charged as a failed attempt,
// so the run ends dead, its dead letter replayable, as a run whose calls keep killing workers does.
for (const batched of [false, true]) {
  test(`a replacement that fails every time ends the run dead after its forgiven hand-backs and its attempts, uncalled${batched ? ' (batched writes)' : ''}`, async () => {
    const { job, newer } = await olderAndNewer();
    await failReplacements(job, 1_000_000);
    const calls: string[] = [];
    const releases = createReleaseBatcher(db.pool, B, TOPICS.runsTopic);
    const failures = createFailureBatcher(db.pool, B, TOPICS);
    const b: AttemptContext = batched
      ? {
          ...worker(B, calls),
          release: (run, report, expiryBound) => releases.add({ run, report, expiryBound }),
          fail: (run, report, retryDelayMs) => failures.add({ run, report, retryDelayMs }),
        }
      : worker(B, calls);
    let claims = 0;
    // A 200 ms grace: each claim retries the replacement for ≈200 ms. Bounded here in case it loops.
    for (; claims < 8; claims++) {
      const [run] = await claimRuns(db.pool, [{ runId: newer, expectedAttempt: null }], {
        nodeId: B,
        ...OPTIONS,
        graceMs: 200,
      });
      if (!run) break;
      await runAttempt(b, run, new AbortController().signal);
    }
    assert.deepEqual(calls, []);
    const { rows } = await db.pool.query(
      `SELECT r.state, r.attempt, r.max_attempts, r.expiries,
              (SELECT count(*)::int FROM dead_letters d WHERE d.run_id = r.id) AS letters
       FROM runs r WHERE r.id = $1`,
      [newer],
    );
    // Forgiven twice (max_attempts 3 + 2), then charged for its 3 attempts.
    assert.deepEqual(rows[0], { state: 'dead', attempt: 5, max_attempts: 5, expiries: 2, letters: 1 });
    assert.equal(claims, FORGIVEN_EXPIRIES + 3);
    const executed = (await b.metrics.runsExecuted.get()).values.map((v) => `${v.labels.outcome}=${v.value}`);
    assert.deepEqual(executed, ['replace-failed=5']);
  });
}
