import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import {
  attemptsOf,
  insertJob,
  nextWholeSecond,
  oncePerMinuteAt,
  runsOf,
  stopJobs,
  waitFor,
} from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';

// A call that finished is recorded even when the first write of its outcome fails (contract
// item 10): the worker retries the conditional completion while its claim holds, and a batch of
// completions that fails is retried item by item. The failures are PostgreSQL's own: a trigger
// on `runs` raises an error for the writes we choose, as a broken connection or a statement
// timeout would.

let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture({
    // A /late-claim call takes long enough that the reaper re-queues its expired claim meanwhile.
    behaviour: (request) =>
      request.path.startsWith('/late-claim') ? { status: 200, delayMs: 800 } : { status: 200 },
  });
  // nextval() is not rolled back with the failing transaction, so "only the first" holds.
  await fx.db.pool.query(`
    CREATE SEQUENCE injected_failures;
    CREATE SEQUENCE late_claims;
    CREATE FUNCTION inject_completion_failure() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      -- The first claim of a /late-claim run answers only after its claim has expired.
      IF NEW.state = 'running' AND OLD.state = 'queued' AND NEW.target->>'url' LIKE '%/late-claim%'
         AND nextval('late_claims') = 1 THEN
        PERFORM pg_sleep(2.5);
      END IF;
      IF NEW.state = 'succeeded' AND OLD.state = 'running' THEN
        IF NEW.target->>'url' LIKE '%/poison%' THEN
          RAISE EXCEPTION 'injected: this completion always fails';
        END IF;
        IF NEW.target->>'url' LIKE '%/fail-once%' AND nextval('injected_failures') = 1 THEN
          RAISE EXCEPTION 'injected: the first completion fails';
        END IF;
      END IF;
      RETURN NEW;
    END $$;
    CREATE TRIGGER inject_completion_failure BEFORE UPDATE ON runs
      FOR EACH ROW EXECUTE FUNCTION inject_completion_failure();`);
  // A short claim, so that before the fix the reaper re-ran the call within the test.
  await fx.start('settle-1', { HELIOS_CLAIM_GRACE_MS: '1000', HELIOS_REAPER_INTERVAL_MS: '200' });
});
after(() => fx.teardown());

test('a finished call whose first completion write fails is recorded once and not executed again', async () => {
  const at = await nextWholeSecond(fx.db.pool, 1000);
  const jobId = await insertJob(fx.db.pool, {
    name: `fail-once-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${fx.target.url}/fail-once` },
    nextRunAt: at,
    timeoutMs: 1000,
    maxAttempts: 3,
  });
  const [run] = await waitFor('the run to finish', async () => {
    const runs = await runsOf(fx.db.pool, jobId);
    return runs.length > 0 && !['queued', 'running'].includes(runs[0]!.state) ? runs : null;
  });
  await stopJobs(fx.db.pool, [jobId]);
  await sleep(2500); // longer than the claim: a re-execution would have happened by now
  const { rows } = await fx.db.pool.query<{ n: number }>(
    `SELECT last_value::int AS n FROM injected_failures`,
  );
  assert.ok(rows[0]!.n >= 1, 'the first completion write did fail');
  assert.equal(run!.state, 'succeeded');
  assert.equal(fx.target.forJob(jobId).length, 1, 'the target was called once');
  const attempts = await attemptsOf(fx.db.pool, run!.id);
  assert.deepEqual(
    attempts.map((a) => [a.attempt, a.outcome]),
    [[1, 'succeeded']],
  );
});

test('a failed batch of completions is retried item by item: one poisoned completion costs no other run', async () => {
  const at = await nextWholeSecond(fx.db.pool, 1500);
  const healthy: string[] = [];
  for (let i = 0; i < 40; i++) {
    healthy.push(
      await insertJob(fx.db.pool, {
        name: `batch-${i}-${uniqueId()}`,
        schedule: oncePerMinuteAt(at),
        target: { url: `${fx.target.url}/healthy/${i}` },
        nextRunAt: at,
        timeoutMs: 1000,
        maxAttempts: 3,
      }),
    );
  }
  const poisoned = await insertJob(fx.db.pool, {
    name: `poison-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${fx.target.url}/poison` },
    nextRunAt: at,
    timeoutMs: 1000,
    maxAttempts: 1,
  });
  await waitFor('every healthy run to finish', async () => {
    const { rows } = await fx.db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM runs WHERE job_id = ANY($1::uuid[]) AND state NOT IN ('queued', 'running')`,
      [healthy],
    );
    return rows[0]!.n === healthy.length;
  });
  await stopJobs(fx.db.pool, [...healthy, poisoned]);
  await sleep(2500);
  assert.ok(fx.target.forJob(poisoned).length >= 1, 'the poisoned run was called');
  const { rows } = await fx.db.pool.query<{ state: string; n: number }>(
    `SELECT state, count(*)::int AS n FROM runs WHERE job_id = ANY($1::uuid[]) GROUP BY state`,
    [healthy],
  );
  assert.deepEqual(rows, [{ state: 'succeeded', n: healthy.length }]);
  const repeated = healthy.filter((id) => fx.target.forJob(id).length !== 1);
  assert.deepEqual(repeated, [], 'every healthy run reached the target exactly once');
});

/** A run as a worker leaves it when it dies right after its claim committed: running, expired. */
async function strandedRun(jobId: string, extra: { expiries?: number } = {}): Promise<string> {
  const columns = extra.expiries === undefined ? '' : ', expiries';
  const values = extra.expiries === undefined ? '' : `, ${extra.expiries}`;
  const { rows } = await fx.db.pool.query<{ id: string }>(
    `WITH run AS (
       INSERT INTO runs (job_id, scheduled_for, trigger, state, attempt, max_attempts, target, timeout_ms,
                         backoff_ms, backoff_multiplier, concurrency, not_before, claimed_by,
                         claim_expires_at, started_at${columns})
       SELECT id, now() - interval '3 seconds', 'manual', 'running', 1, max_attempts, target, timeout_ms,
              backoff_ms, backoff_multiplier, concurrency, now() - interval '3 seconds', 'ghost-worker',
              now() - interval '1 millisecond', now() - interval '3 seconds'${values}
       FROM jobs WHERE id = $1
       RETURNING id)
     INSERT INTO run_attempts (run_id, attempt, node_id, started_at)
     SELECT id, 1, 'ghost-worker', now() - interval '3 seconds' FROM run RETURNING run_id AS id`,
    [jobId],
  );
  return rows[0]!.id;
}

test('an expired claim costs no attempt: a maxAttempts 1 run whose worker died before calling still runs', async () => {
  const jobId = await insertJob(fx.db.pool, {
    name: `stranded-${uniqueId()}`,
    schedule: '0 0 1 1 *',
    target: { url: `${fx.target.url}/stranded` },
    nextRunAt: new Date(Date.now() + 365 * 86_400_000),
    timeoutMs: 1000,
    maxAttempts: 1,
  });
  const runId = await strandedRun(jobId);
  const finished = await waitFor('the stranded run to finish', async () => {
    const { rows } = await fx.db.pool.query<{ state: string }>('SELECT state FROM runs WHERE id = $1', [
      runId,
    ]);
    return ['succeeded', 'dead'].includes(rows[0]!.state) ? rows[0]! : null;
  });
  assert.equal(finished.state, 'succeeded', 'the run was not charged for its worker dying');
  assert.deepEqual(
    fx.target.forJob(jobId).map((r) => r.runId),
    [runId],
  );
  assert.deepEqual(
    (await attemptsOf(fx.db.pool, runId)).map((a) => [a.attempt, a.outcome]),
    [
      [1, 'expired'],
      [2, 'succeeded'],
    ],
  );
});

test('expiries beyond the bound count as failed attempts, so a job that keeps killing workers ends dead', async () => {
  const jobId = await insertJob(fx.db.pool, {
    name: `crash-loop-${uniqueId()}`,
    schedule: '0 0 1 1 *',
    target: { url: `${fx.target.url}/crash-loop` },
    nextRunAt: new Date(Date.now() + 365 * 86_400_000),
    timeoutMs: 1000,
    maxAttempts: 1,
  });
  // Two expiries already forgiven: the third is charged, and with one attempt the run is dead.
  const runId = await strandedRun(jobId, { expiries: 2 });
  await waitFor('the run to be dead', async () => {
    const { rows } = await fx.db.pool.query<{ state: string }>('SELECT state FROM runs WHERE id = $1', [
      runId,
    ]);
    return rows[0]!.state === 'dead';
  });
  const { rows } = await fx.db.pool.query<{ n: number }>(
    'SELECT count(*)::int AS n FROM dead_letters WHERE run_id = $1',
    [runId],
  );
  assert.equal(rows[0]!.n, 1, 'a dead letter records it');
  assert.equal(fx.target.forJob(jobId).length, 0);

  // A replay of the crash-looped run starts its forgiven expiries again: when the worker that
  // claims the replay dies before calling (stranded here right after the replay commits, well
  // before its announcement can travel through the outbox and Kafka to a worker), it costs no
  // attempt and the run is still delivered.
  const letter = await fx.db.pool.query<{ id: string }>('SELECT id FROM dead_letters WHERE run_id = $1', [
    runId,
  ]);
  const replay = await replayDeadLetter(fx.db.pool, letter.rows[0]!.id, { runsTopic: fx.topic });
  assert.ok(replay, 'the dead letter was replayed');
  const stranded = await fx.db.pool.query(
    `WITH run AS (
       UPDATE runs SET state = 'running', attempt = $2, claimed_by = 'ghost-worker', started_at = now(),
                       claim_expires_at = now() - interval '1 millisecond'
       WHERE id = $1 AND state = 'queued' AND attempt = $2 - 1
       RETURNING id)
     INSERT INTO run_attempts (run_id, attempt, node_id, started_at)
     SELECT id, $2, 'ghost-worker', now() FROM run`,
    [runId, replay.attempt],
  );
  assert.equal(stranded.rowCount, 1, 'the replayed run was stranded before a worker claimed it');
  const finished = await waitFor('the replayed run to finish', async () => {
    const { rows } = await fx.db.pool.query<{ state: string }>('SELECT state FROM runs WHERE id = $1', [
      runId,
    ]);
    return ['succeeded', 'dead'].includes(rows[0]!.state) ? rows[0]! : null;
  });
  assert.equal(finished.state, 'succeeded', 'the replay was not charged for its worker dying');
  assert.equal(fx.target.forJob(jobId).length, 1);
});

test('a claim acknowledged after it expired does not make the call: the run is delivered once', async () => {
  const at = await nextWholeSecond(fx.db.pool, 1000);
  // timeout 1000 + grace 1000: the claim expires 2 s after it was made, the answer comes after 2.5 s.
  const jobId = await insertJob(fx.db.pool, {
    name: `late-claim-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${fx.target.url}/late-claim` },
    nextRunAt: at,
    timeoutMs: 1000,
    maxAttempts: 3,
  });
  const [run] = await waitFor(
    'the run to finish',
    async () => {
      const runs = await runsOf(fx.db.pool, jobId);
      return runs.length > 0 && !['queued', 'running'].includes(runs[0]!.state) ? runs : null;
    },
    30_000,
  );
  await stopJobs(fx.db.pool, [jobId]);
  await sleep(1500);
  assert.equal(run!.state, 'succeeded');
  assert.equal(fx.target.forJob(jobId).length, 1, 'the target was called once');
});
