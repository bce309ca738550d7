import assert from 'node:assert/strict';
import { after, before, beforeEach, test } from 'node:test';
import { inTransaction } from '../../src/store/db.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import { explainClaimMiss, isForbidViolation } from '../../src/store/runs.js';
import { readClusterCounts } from '../../src/store/signals.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { queuedRuns } from '../support/execution.js';
import { CLAIM_OPTIONS, TOPICS, forbidEdits } from '../support/forbid-edits.js';

// A run copies its job's `concurrency` when it is created, and its retries and replays keep that
// copy. A `forbid` run waits for a sibling running beside it; for one that copied another policy
// only while the job keeps its runs apart (`forbid` or `replace`): that wait is for an edit to
// `forbid` during an `allow` call. A `forbid` job's retry that waited the same way after an edit to
// `allow` never started while the job's new runs overlapped (an every-second job whose calls take
// longer than a second always has one running), yet contract item 10 says it waits its turn.
// The Kafka path's claim, the polling fallback and the leader's counts must agree on which it is.

let db: TestDatabase;

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());
// Each test's runs alone (the counts read the whole table; cascades to them).
beforeEach(() => db.pool.query('DELETE FROM jobs'));

const { jobWithRun, runningRun, claim, failOnce, patchConcurrency, stateOf, succeed } = forbidEdits(
  () => db.pool,
);

/** The leader's view: queued runs overdue (0 ms threshold: every due one) and forbid waits. */
async function counts() {
  const c = await readClusterCounts(db.pool, 0, 1000);
  return { overdue: c.runsOverdue, waitingForbid: c.runsWaitingForbid };
}

/** A poll of the polling fallback for runs overdue by 0 ms; the ids it claimed. */
const poll = () =>
  inTransaction(db.pool, async (client) =>
    (await claimOverdueRuns(client, 0, 10, { nodeId: 'node-c', ...CLAIM_OPTIONS })).claimed.map((r) => r.id),
  );

test('a forbid retry of a job PATCHed to allow is claimed beside the allow run the job now has running', async () => {
  const { job, run: retry } = await jobWithRun('forbid');
  assert.equal((await failOnce(retry))?.state, 'queued');
  await patchConcurrency(job, 'allow');
  // The job's runs since the edit overlap: one of them is always running.
  const allowRun = await runningRun(job);
  assert.deepEqual(await stateOf(retry), { state: 'queued', attempt: 1, concurrency: 'forbid' });
  assert.equal((await stateOf(allowRun)).concurrency, 'allow');
  const claimed = await claim(retry);
  assert.equal(claimed?.attempt, 2, 'the retry starves behind the allow runs of a job that forbids nothing');
  assert.equal((await stateOf(allowRun)).state, 'running');
});

test('the polling fallback claims that retry too, and the leader counts it overdue, not waiting', async () => {
  const { job, run: retry } = await jobWithRun('forbid');
  assert.equal((await failOnce(retry))?.state, 'queued');
  await patchConcurrency(job, 'allow');
  await runningRun(job);
  assert.deepEqual(await counts(), { overdue: 1, waitingForbid: 0 }, 'the retry is not waiting for anything');
  assert.equal((await explainClaimMiss(db.pool, retry))?.forbidBlocked, false);
  assert.deepEqual(await poll(), [retry], 'the polling fallback leaves the retry out of every poll');
  assert.equal((await stateOf(retry)).state, 'running');
});

test('a forbid replay of a job PATCHed to allow still waits for a run that copied forbid, and only for it', async () => {
  const { job, run: replayed } = await jobWithRun('forbid');
  // Dead at its first call, then replayed while a forbid run of the job runs: both copied forbid.
  const dead = await failOnce(replayed, false);
  assert.equal(dead?.state, 'dead');
  const forbidRun = await runningRun(job, 2);
  assert.ok(dead?.state === 'dead' && (await replayDeadLetter(db.pool, dead.deadLetterId, TOPICS)));
  await patchConcurrency(job, 'allow');
  const allowRun = await runningRun(job, 1, 'node-d');
  assert.deepEqual(
    [(await stateOf(replayed)).concurrency, (await stateOf(forbidRun)).concurrency],
    ['forbid', 'forbid'],
  );

  // Two runs that copied forbid never run at once: the claim misses it (or the unique index refuses it).
  const refused = await claim(replayed).catch((err: unknown) => {
    assert.ok(isForbidViolation(err), String(err));
    return null;
  });
  assert.equal(refused, null);
  assert.deepEqual(await poll(), []);
  assert.deepEqual(await counts(), { overdue: 0, waitingForbid: 1 });
  assert.equal((await explainClaimMiss(db.pool, replayed))?.forbidBlocked, true);

  // The forbid run ends; the allow run still runs, and the replay is claimed beside it.
  await succeed(forbidRun);
  assert.deepEqual(await counts(), { overdue: 1, waitingForbid: 0 });
  assert.equal((await claim(replayed))?.attempt, 2);
  assert.equal((await stateOf(allowRun)).state, 'running');
});

test('an edit from allow to forbid still keeps a forbid run from starting beside the allow run in flight', async () => {
  const { job, run: dead } = await jobWithRun('allow');
  const buried = await failOnce(dead, false);
  assert.equal(buried?.state, 'dead');
  const allowRun = await runningRun(job);
  await patchConcurrency(job, 'forbid');
  // A fresh occurrence copies the job as it is now: forbid. It is not called beside the allow run.
  const [fresh] = await queuedRuns(db.pool, job, ['now()']);
  assert.equal((await stateOf(fresh!)).concurrency, 'forbid');
  assert.equal(await claim(fresh!), null, 'the fresh occurrence is called beside the allow run');
  assert.equal((await explainClaimMiss(db.pool, fresh!))?.forbidBlocked, true, 'and so is not skipped');
  // A replay takes the job as it is now too: it waits for the allow run.
  assert.ok(buried?.state === 'dead' && (await replayDeadLetter(db.pool, buried.deadLetterId, TOPICS)));
  assert.equal((await stateOf(dead)).concurrency, 'forbid');
  assert.equal(await claim(dead), null, 'the replay is called beside the allow run');
  assert.equal((await explainClaimMiss(db.pool, dead))?.forbidBlocked, true);
  // The waiting replay is counted apart from the overdue runs (the fresh occurrence is overdue).
  assert.deepEqual(await counts(), { overdue: 1, waitingForbid: 1 });
  // The polling fallback leaves the replay alone and skips the fresh occurrence, as forbid says.
  assert.deepEqual(await poll(), []);
  assert.deepEqual([(await stateOf(dead)).state, (await stateOf(fresh!)).state], ['queued', 'skipped']);

  await succeed(allowRun);
  assert.equal((await claim(dead))?.attempt, 2);
});

test('an edit from forbid to replace keeps a forbid retry from starting beside the replace run in flight', async () => {
  const { job, run: retry } = await jobWithRun('forbid');
  assert.equal((await failOnce(retry))?.state, 'queued');
  await patchConcurrency(job, 'replace');
  const replaceRun = await runningRun(job);
  assert.equal((await stateOf(replaceRun)).concurrency, 'replace');
  // replace never runs two calls of the job at once: its newer run replaces the waiting retry
  // (REPLACE_OLDER, at that run's start; not written here), the claim never calls it beside it.
  assert.equal(await claim(retry), null);
  assert.deepEqual(await counts(), { overdue: 0, waitingForbid: 1 });
});
