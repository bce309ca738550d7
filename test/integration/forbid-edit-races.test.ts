import assert from 'node:assert/strict';
import { after, before, beforeEach, test } from 'node:test';
import pg from 'pg';
import { createClaimBatcher } from '../../src/execution/batching.js';
import { inTransaction } from '../../src/store/db.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import { claimRuns, explainClaimMiss, isForbidViolation, type ClaimedRun } from '../../src/store/runs.js';
import { readClusterCounts } from '../../src/store/signals.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilWaitingForLocks } from '../support/execution.js';
import { CLAIM_OPTIONS, TOPICS, forbidEdits } from '../support/forbid-edits.js';

// A `forbid` retry or replay waits for a running sibling that copied another policy only while its
// job is not `allow` now (forbid-edited-retry.test.ts): the claim reads the job row, which no write
// of `runs` guards. These tests put an edit of the job's concurrency against the claims, the
// polling fallback and the leader's counts, on the real PostgreSQL. The first two failed before
// the claim locked the job row as it reads it (jobKeepsRunsApartLocked in store/runs.ts); the third
// pins that this lock is never waited for (the unlocked read called the retry there, harmlessly);
// the last two pin what held already (a batch that breaks runs_forbid_one_running_idx, and the
// readers agreeing on a waiting retry).

let db: TestDatabase;
/** Room for a held transaction, a blocked claim, a blocked edit and the test's own look at them. */
let pool: pg.Pool;

before(async () => {
  db = await createTestDatabase();
  pool = new pg.Pool({ connectionString: db.url, max: 8, options: '-c TimeZone=UTC' });
  pool.on('error', () => undefined);
});
after(async () => {
  await pool.end();
  await db.drop();
});
// Each test's runs alone (the counts read the whole table; cascades to them).
beforeEach(() => pool.query('DELETE FROM jobs'));

const { jobWithRun, occurrence, runningRun, claim, failOnce, patchConcurrency, stateOf, succeed } =
  forbidEdits(() => pool);

/**
 * What each reader says about queued `forbid` run `runId` now, without changing anything (every
 * claim rolled back): whether a worker's claim takes it, whether a poll of the polling fallback
 * takes it, whether a missed claim is explained as a forbid wait, and the leader's counts (0 ms
 * overdue threshold: every due run is overdue unless it waits).
 */
async function views(runId: string) {
  const probe = <T>(read: (client: pg.PoolClient) => Promise<T>) =>
    inTransaction(pool, async (client) => {
      const seen = await read(client);
      throw Object.assign(new Error('probe'), { seen });
    }).catch((err: unknown) => {
      const e = err as { message?: string; seen?: T };
      if (e.message !== 'probe') throw err;
      return e.seen as T;
    });
  const claimed = await probe(async (client) => {
    try {
      const [run] = await claimRuns(client, [{ runId, expectedAttempt: null }], {
        nodeId: 'probe',
        ...CLAIM_OPTIONS,
      });
      return Boolean(run);
    } catch (err) {
      if (!isForbidViolation(err)) throw err;
      return false;
    }
  });
  const polled = await probe(async (client) =>
    (await claimOverdueRuns(client, 0, 10, { nodeId: 'probe', ...CLAIM_OPTIONS })).claimed.some(
      (r) => r.id === runId,
    ),
  );
  const forbidBlocked = (await explainClaimMiss(pool, runId))?.forbidBlocked ?? null;
  const c = await readClusterCounts(pool, 0, 1000);
  return { claimed, polled, forbidBlocked, overdue: c.runsOverdue, waitingForbid: c.runsWaitingForbid };
}

/** The readers agree: a due retry nothing else waits beside is claimable or waiting, never both or neither. */
function agreeing(waits: boolean) {
  return waits
    ? { claimed: false, polled: false, forbidBlocked: true, overdue: 0, waitingForbid: 1 }
    : { claimed: true, polled: true, forbidBlocked: false, overdue: 1, waitingForbid: 0 };
}

/**
 * A forbid retry of a job edited to allow, an allow call in flight, and an occurrence due before
 * the edit that copied allow (`fresh`), with the id `freshId`: a claim takes the two in id order, so
 * the id says whether the claim reads the retry's job before or after it waits for `fresh`. The
 * polling fallback's SELECT holds both rows (FOR UPDATE) when a worker's claim of both comes: the
 * claim has its snapshot (the job still allow) and waits for the rows. Meanwhile the job is edited
 * to forbid, then the poll's transaction ends. What the claim returned, and which answered first.
 */
async function claimHeldAcrossEditToForbid(freshId: string) {
  const { job, run: retry } = await jobWithRun('forbid');
  assert.equal((await failOnce(retry))?.state, 'queued');
  await patchConcurrency(job, 'allow');
  const allowRun = await runningRun(job, 2);
  const fresh = await occurrence(job, 1);
  await pool.query('UPDATE runs SET id = $2 WHERE id = $1', [fresh, freshId]);

  const poller = await pool.connect();
  const order: string[] = [];
  let claimed: Promise<(ClaimedRun | null)[]>;
  let patched: Promise<void>;
  try {
    await poller.query('BEGIN');
    await poller.query('SELECT id FROM runs WHERE id = ANY($1::uuid[]) ORDER BY id FOR UPDATE', [
      [retry, freshId],
    ]);
    claimed = claimRuns(
      pool,
      [retry, freshId].map((runId) => ({ runId, expectedAttempt: null })),
      { nodeId: 'node-k', ...CLAIM_OPTIONS },
    ).then((runs) => (order.push('claim'), runs));
    await untilWaitingForLocks(pool, { timeoutMs: 5_000, everyMs: 10 });
    // The edit answers at once, or waits for the claim.
    patched = patchConcurrency(job, 'forbid').then(() => void order.push('patch'));
    await Promise.race([patched, untilWaitingForLocks(pool, { count: 2, timeoutMs: 5_000, everyMs: 10 })]);
  } finally {
    await poller.query('COMMIT');
    poller.release();
  }
  const [retryClaim, freshClaim] = await claimed;
  await patched;
  // The occurrence that copied allow is called either way: it fell due before the edit's line and
  // runs as the job was then, beside the allow call.
  assert.equal(freshClaim?.attempt, 1);
  assert.equal((await stateOf(allowRun)).state, 'running');
  return { retry, retryClaim, order };
}

test('a claim that read the job before an edit to forbid and then waited for a row: the edit waits for it, so the forbid retry it calls beside the allow call is before the edit', async () => {
  // The retry first: the claim reads its job, then waits for the occurrence's row.
  const { retryClaim, order } = await claimHeldAcrossEditToForbid('ffffffff-ffff-4fff-bfff-ffffffffffff');
  assert.deepEqual(
    order,
    ['claim', 'patch'],
    'the edit to forbid answered before the claim that called the retry beside the allow call',
  );
  assert.equal(retryClaim?.attempt, 2);
});

test('a claim whose snapshot predates an edit to forbid, waiting for a row while the edit commits, leaves the forbid retry waiting for the allow call', async () => {
  // The occurrence first: the claim waits for its row before it reads the retry's job.
  const { retry, retryClaim, order } = await claimHeldAcrossEditToForbid(
    '00000000-0000-4000-8000-000000000000',
  );
  assert.deepEqual(order, ['patch', 'claim']);
  // README: once the edit to forbid has answered, a forbid retry waits for the allow call in flight.
  assert.equal(
    retryClaim,
    null,
    'the retry was called beside the allow call after the edit to forbid answered',
  );
  assert.deepEqual(await stateOf(retry), { state: 'queued', attempt: 1, concurrency: 'forbid' });
  assert.deepEqual(await views(retry), agreeing(true));
});

test('a claim does not wait for the job row a command holds: the forbid retry waits its turn instead, and is claimed once the command ends', async () => {
  const { job, run: retry } = await jobWithRun('forbid');
  assert.equal((await failOnce(retry))?.state, 'queued');
  await patchConcurrency(job, 'allow');
  await runningRun(job, 2);
  // An edit, a pause or the dispatcher holds the job row (findJob ... FOR UPDATE). The claim may hold
  // other runs of the job the command waits for, so it must not wait for the row in turn.
  const command = await pool.connect();
  try {
    await command.query('BEGIN');
    await command.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [job]);
    const waited = new Promise<'waited'>((resolve) => setTimeout(() => resolve('waited'), 2000).unref());
    assert.equal(await Promise.race([claim(retry), waited]), null);
    // The worker's claim then holds the run again (a retry is never skipped).
    assert.equal((await explainClaimMiss(pool, retry))?.forbidBlocked, true);
  } finally {
    await command.query('COMMIT');
    command.release();
  }
  assert.equal((await claim(retry))?.attempt, 2);
});

test('a forbid retry and a forbid replay of a job edited to allow, in one claim batch beside its allow call: one is claimed, the other waits, the rest of the batch is claimed', async () => {
  const { job, run: retry } = await jobWithRun('forbid');
  // Dead first: a fresh occurrence of a forbid job is not claimed while a retry waits.
  const replayed = await occurrence(job, 2);
  const dead = await failOnce(replayed, false);
  assert.equal((await failOnce(retry))?.state, 'queued');
  assert.ok(dead?.state === 'dead' && (await replayDeadLetter(pool, dead.deadLetterId, TOPICS)));
  await patchConcurrency(job, 'allow');
  const allowRun = await runningRun(job, 1);
  // Another job's run in the same batch.
  const { run: other } = await jobWithRun('allow');
  assert.deepEqual(
    [(await stateOf(retry)).concurrency, (await stateOf(replayed)).concurrency],
    ['forbid', 'forbid'],
  );

  // Both pass CLAIM's test (neither sees the other running), so the statement breaks the unique index.
  const requests = [retry, replayed, other].map((runId) => ({ runId, expectedAttempt: null }));
  await assert.rejects(claimRuns(pool, requests, { nodeId: 'node-a', ...CLAIM_OPTIONS }), isForbidViolation);

  // A worker's batcher then claims item by item: one of the two, and the other job's run.
  const batcher = createClaimBatcher(pool, { nodeId: 'node-a', ...CLAIM_OPTIONS });
  const results = await Promise.all(requests.map((request) => batcher.add(request)));
  const [first, second, third] = results.map((r) => (typeof r === 'string' ? r : r.attempt));
  assert.equal(third, 1, "the other job's run in the failed batch is claimed");
  assert.deepEqual([first, second].sort(), [2, 'forbidden'].sort());
  const [claimedOne, waiting] = first === 2 ? [retry, replayed] : [replayed, retry];
  assert.deepEqual(await stateOf(waiting), { state: 'queued', attempt: 1, concurrency: 'forbid' });
  // The other waits for the one that copied forbid: not claimed, not polled, counted waiting.
  assert.deepEqual(await views(waiting), agreeing(true));

  await succeed(claimedOne);
  assert.deepEqual(await views(waiting), agreeing(false));
  assert.equal((await claim(waiting))?.attempt, 2);
  assert.equal((await stateOf(allowRun)).state, 'running');
});

test('the claims, the polling fallback and the counts agree on a waiting forbid retry through forbid, allow, forbid, replace and allow again', async () => {
  const { job, run: retry } = await jobWithRun('forbid');
  // A replay of another occurrence runs (a fresh one is not claimed while the retry waits): the
  // retry waits for it, as it copied forbid too, whatever the job becomes.
  const forbidRun = await occurrence(job, 2);
  const dead = await failOnce(forbidRun, false);
  assert.equal((await failOnce(retry))?.state, 'queued');
  assert.ok(dead?.state === 'dead' && (await replayDeadLetter(pool, dead.deadLetterId, TOPICS)));
  assert.equal((await claim(forbidRun, 'node-b'))?.attempt, 2);
  assert.deepEqual(await views(retry), agreeing(true));
  await patchConcurrency(job, 'allow');
  assert.deepEqual(await views(retry), agreeing(true));
  const allowRun = await runningRun(job, 1, 'node-d');
  await patchConcurrency(job, 'forbid');
  assert.deepEqual(await views(retry), agreeing(true));

  // The forbid run ends; the allow run from the allow spell still runs, and the job is forbid.
  await succeed(forbidRun);
  assert.deepEqual(await views(retry), agreeing(true));
  await patchConcurrency(job, 'replace');
  assert.deepEqual(await views(retry), agreeing(true));
  await patchConcurrency(job, 'allow');
  assert.deepEqual(await views(retry), agreeing(false));
  await patchConcurrency(job, 'forbid');
  assert.deepEqual(await views(retry), agreeing(true));

  await succeed(allowRun);
  assert.deepEqual(await views(retry), agreeing(false));
  assert.equal((await claim(retry))?.attempt, 2);
});
