import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import {
  failAttempt,
  releaseClaim,
  selectExpiredRuns,
  type AttemptReport,
} from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';
import { forgiveExpiredClaims } from '../../src/store/releases.js';
import { claimRun, replaceOlderRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { uniqueId } from '../support/env.js';
import { insertJob } from '../support/execution.js';

// The statements behind a run's retry back-off and `replace`, on a real PostgreSQL with no node
// running (nothing else claims the runs): how many failed calls a claim reports for the back-off
// (store/runs.ts failuresBefore), and which runs a `replace` claim fails (replaceOlderRuns).

let db: TestDatabase;
const NODE = 'w';
const topics = { runsTopic: 'backoff.runs', deadLetterTopic: 'backoff.dlq' };
const claim = (runId: string) =>
  claimRun(db.pool, runId, { nodeId: NODE, graceMs: 1000, skewToleranceMs: 0 }, null);
const failed: AttemptReport = {
  outcome: 'failed',
  statusCode: 500,
  durationMs: 3,
  error: 'HTTP 500',
  responseExcerpt: null,
};
const cancelled: AttemptReport = {
  outcome: 'cancelled',
  statusCode: null,
  durationMs: null,
  error: 'handed back',
  responseExcerpt: null,
};

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** A job that is never dispatched, and one queued run of it `agoS` seconds old, due. */
async function jobWithRun(concurrency: 'allow' | 'replace', maxAttempts: number, agoS = 60) {
  const jobId = await insertJob(db.pool, {
    name: `job-${uniqueId()}`,
    schedule: '* * * * * *',
    target: { url: 'http://127.0.0.1:9/' },
    nextRunAt: new Date(0),
    concurrency,
    maxAttempts,
    backoffMs: 0,
  });
  await db.pool.query('UPDATE jobs SET next_run_at = NULL WHERE id = $1', [jobId]);
  return { jobId, runId: await addRun(jobId, agoS) };
}

async function addRun(jobId: string, agoS: number): Promise<string> {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, date_trunc('second', now()) - $2 * interval '1 second', 'queued', max_attempts, target,
            timeout_ms, backoff_ms, backoff_multiplier, concurrency, now() - interval '1 second'
     FROM jobs WHERE id = $1 RETURNING id`,
    [jobId, agoS],
  );
  return rows[0]!.id;
}

const fail = (run: ClaimedRun) =>
  inTransaction(db.pool, (c) => failAttempt(c, run, { nodeId: NODE }, failed, 0, topics));

async function state(runId: string) {
  const { rows } = await db.pool.query<{ state: string; reason: string | null }>(
    'SELECT state, reason FROM runs WHERE id = $1',
    [runId],
  );
  return rows[0];
}

test('the back-off counts failed calls since the last replay, not attempt numbers', async () => {
  const { runId } = await jobWithRun('allow', 2);
  const first = (await claim(runId))!;
  assert.deepEqual([first.attempt, first.failuresBefore], [1, 0]);

  // Handed back uncalled: an attempt number, no failure.
  await inTransaction(db.pool, (c) => releaseClaim(c, first, NODE, cancelled, topics.runsTopic));
  const second = (await claim(runId))!;
  assert.deepEqual([second.attempt, second.failuresBefore], [2, 0]);
  await fail(second);

  // Its claim expired and the reaper forgave it: an attempt number, no failure.
  const third = (await claim(runId))!;
  assert.deepEqual([third.attempt, third.failuresBefore], [3, 1]);
  await db.pool.query(`UPDATE runs SET claim_expires_at = now() - interval '1 second' WHERE id = $1`, [
    runId,
  ]);
  const [expired] = await selectExpiredRuns(db.pool, 10);
  assert.deepEqual([expired?.attempt, expired?.failuresBefore], [3, 1]);
  await forgiveExpiredClaims(db.pool, [{ run: third, error: 'claim expired' }], 2, topics.runsTopic);

  const fourth = (await claim(runId))!;
  assert.deepEqual([fourth.attempt, fourth.failuresBefore], [4, 1]);
  assert.equal((await fail(fourth))?.state, 'dead');

  // A replay: a fresh budget, and a fresh back-off.
  const { rows } = await db.pool.query<{ id: string }>('SELECT id FROM dead_letters WHERE run_id = $1', [
    runId,
  ]);
  assert.ok(await replayDeadLetter(db.pool, rows[0]!.id, topics));
  const fifth = (await claim(runId))!;
  assert.deepEqual([fifth.attempt, fifth.failuresBefore], [5, 0]);
  await fail(fifth);
  const sixth = (await claim(runId))!;
  assert.deepEqual([sixth.attempt, sixth.failuresBefore], [6, 1]);
});

test('replace: a claim fails the runs asked for before it that wait queued, not those asked for after', async () => {
  const { jobId, runId: older } = await jobWithRun('replace', 3, 60);
  // The older run failed once and waits in its back-off.
  await fail((await claim(older))!);
  await db.pool.query(`UPDATE runs SET not_before = now() + interval '1 minute' WHERE id = $1`, [older]);
  const newer = await addRun(jobId, 30);
  const later = await addRun(jobId, -60); // an occurrence a minute from now, created ahead
  assert.ok(await claim(newer));
  assert.deepEqual(await replaceOlderRuns(db.pool, jobId), {
    replaced: [older],
    running: { id: newer, attempt: 1, nodeId: NODE },
  });
  assert.deepEqual(await state(older), { state: 'failed', reason: 'replaced' });
  assert.deepEqual(await state(later), { state: 'queued', reason: null });
  await db.pool.query(`UPDATE runs SET not_before = now() - interval '1 second' WHERE id = $1`, [older]);
  assert.equal(await claim(older), null, 'the replaced run is not claimed when its retry falls due');
});
