import assert from 'node:assert/strict';
import { after, before, beforeEach, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import type { Leadership } from '../../src/coordination/election.js';
import { FORGIVEN_EXPIRIES, Reaper, type ReaperOptions } from '../../src/execution/reaper.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { msUntilNextExpiry } from '../../src/store/attempts.js';
import { claimRun, startRuns, type ClaimOptions } from '../../src/store/runs.js';
import { HANDOFF_CHANNEL, handOffRuns, workersBut } from '../../src/store/handoff.js';
import { parseHandOff } from '../../src/execution/run-message.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// A worker claims a run up to its claim lead before it is due and marks it started (START) right
// before the call. A worker killed in between (an OOM kill at the top of the hour) used to hold
// such runs until their claims' deadlines: due + timeout + grace, 35 s with the defaults. The
// reaper now takes back a run claimed ahead whose call has not begun its claim grace after it fell
// due (store/attempts.ts, claimOver), and never charges an attempt for it: no call was made.

let db: TestDatabase;
const topics = { runsTopic: 'unstarted.runs', deadLetterTopic: 'unstarted.dlq' };
const GRACE_MS = 700;
const ahead = (nodeId: string): ClaimOptions => ({
  nodeId,
  graceMs: GRACE_MS,
  skewToleranceMs: 0,
  leadMs: 2000,
});

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());
beforeEach(() => db.pool.query('DELETE FROM jobs'));

const leadership: Leadership = {
  nodeId: 'leader',
  token: 1n,
  since: new Date(),
  signal: new AbortController().signal,
  isValid: () => true,
};

const reaper = (options: Partial<ReaperOptions> = {}) =>
  new Reaper({
    pool: db.pool,
    leadership,
    topics,
    intervalMs: 1000,
    unstartedAfterMs: GRACE_MS,
    logger: silentLogger,
    metrics: createMetrics('test'),
    onFenced: () => assert.fail('fenced'),
    ...options,
  });

async function until(done: () => boolean): Promise<void> {
  for (const end = Date.now() + 2000; !done(); await sleep(10)) {
    if (Date.now() > end) assert.fail('timed out waiting');
  }
}

/** A job with `timeoutMs` and one queued run of it due `dueInMs` from now. */
async function jobWithRun(options: { dueInMs: number; timeoutMs?: number; maxAttempts?: number }) {
  const { rows } = await db.pool.query<{ id: string; jobId: string }>(
    `WITH job AS (
       INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms)
       VALUES ('unstarted-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', $2, $3, 0)
       RETURNING *)
     INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, now() + $1 * interval '1 millisecond', 'queued', max_attempts, target, timeout_ms,
            backoff_ms, backoff_multiplier, concurrency, now() + $1 * interval '1 millisecond'
     FROM job RETURNING id, job_id AS "jobId"`,
    [options.dueInMs, options.timeoutMs ?? 30_000, options.maxAttempts ?? 1],
  );
  return rows[0]!;
}

async function runOf(id: string) {
  const { rows } = await db.pool.query<{
    state: string;
    attempt: number;
    maxAttempts: number;
    startedAt: Date | null;
    lastError: string | null;
  }>(
    `SELECT state, attempt, max_attempts AS "maxAttempts", started_at AS "startedAt", last_error AS "lastError"
     FROM runs WHERE id = $1`,
    [id],
  );
  return rows[0]!;
}

test('a run claimed ahead whose call never began is taken back its claim grace after it fell due, uncharged; a started one keeps its claim', async () => {
  const unstarted = await jobWithRun({ dueInMs: 300 });
  const started = await jobWithRun({ dueInMs: 300 });
  const a = await claimRun(db.pool, unstarted.id, ahead('worker-a'), 1);
  const b = await claimRun(db.pool, started.id, ahead('worker-a'), 1);
  assert.ok(a?.startPending && b?.startPending, 'both claimed ahead');
  // Forgiven expiries past the bound: a call that never began is forgiven all the same.
  await db.pool.query('UPDATE runs SET expiries = $2 WHERE id = $1', [unstarted.id, FORGIVEN_EXPIRIES + 3]);

  await sleep(300 + GRACE_MS / 2);
  assert.equal((await reaper().reapBatch()).reaped, 0, 'within the grace: its worker may still call it');
  // The worker starts one of them within the grace: that call begins.
  assert.deepEqual(await startRuns(db.pool, 'worker-a', [b!]), [true]);
  await sleep(GRACE_MS / 2 + 150);
  assert.equal((await reaper().reapBatch()).reaped, 1);

  const back = await runOf(unstarted.id);
  assert.deepEqual(
    [back.state, back.attempt, back.maxAttempts, back.startedAt],
    ['queued', 1, 2, null],
    'queued again, no attempt used, still unstarted',
  );
  assert.match(
    back.lastError ?? '',
    /claimed ahead by worker-a, its call not begun 700 ms after it fell due/,
  );
  assert.equal(
    (await runOf(started.id)).state,
    'running',
    'a started run keeps its claim until its deadline',
  );
  const { rows: attempts } = await db.pool.query<{ attempt: number; outcome: string; error: string }>(
    `SELECT attempt, outcome, error FROM run_attempts WHERE run_id = $1`,
    [unstarted.id],
  );
  assert.deepEqual(
    attempts.map((a) => [a.attempt, a.outcome]),
    [[1, 'expired']],
  );
  assert.equal(attempts[0]!.error, back.lastError);
  // Its next attempt is announced as the single path announces one (workers parse it).
  const { rows: outbox } = await db.pool.query<{ payload: Record<string, unknown>; late: boolean }>(
    `SELECT payload, publish_after > now() AS late FROM outbox WHERE payload->>'runId' = $1`,
    [unstarted.id],
  );
  assert.equal(outbox.length, 1);
  const message = outbox[0]!.payload;
  assert.deepEqual(
    [message.attempt, message.jobId, message.timeoutMs, message.concurrency, outbox[0]!.late],
    [2, unstarted.jobId, 30_000, 'allow', false],
  );
  for (const key of ['scheduledFor', 'notBefore']) {
    assert.equal(
      new Date(message[key] as string).toISOString(),
      message[key],
      `${key} as toISOString writes it`,
    );
  }

  // The worker that was taken over wakes up: its START finds the claim gone, so it makes no call.
  assert.deepEqual(await startRuns(db.pool, 'worker-a', [a!]), [false]);
  // Another worker claims it and calls it.
  const again = await claimRun(db.pool, unstarted.id, ahead('worker-b'), 2);
  assert.equal(again?.attempt, 2);
  assert.equal(again?.startPending, false, 'claimed when due: started with its claim');
});

test('without the option the reaper waits for the claim deadline, as before', async () => {
  const { id } = await jobWithRun({ dueInMs: 100 });
  assert.ok((await claimRun(db.pool, id, ahead('worker-a'), 1))?.startPending);
  await sleep(100 + GRACE_MS + 100);
  const plain = new Reaper({
    pool: db.pool,
    leadership,
    topics,
    intervalMs: 1000,
    logger: silentLogger,
    metrics: createMetrics('test'),
    onFenced: () => assert.fail('fenced'),
  });
  assert.equal((await plain.reapBatch()).reaped, 0);
  assert.equal((await reaper().reapBatch()).reaped, 1);
});

test('the reaper sleeps until the next claim is over: an unstarted claim ahead at its due time + grace', async () => {
  const { id } = await jobWithRun({ dueInMs: 1000, timeoutMs: 5000 });
  assert.ok((await claimRun(db.pool, id, ahead('worker-a'), 1))?.startPending);
  const deadline = await msUntilNextExpiry(db.pool);
  const over = await msUntilNextExpiry(db.pool, { unstartedAfterMs: GRACE_MS });
  // The deadline: due (1 s) + timeout (5 s) + the claim's grace (0.7 s).
  assert.ok(deadline! > 6000 && deadline! <= 6700, `deadline in ${deadline} ms`);
  assert.ok(over! > 1000 + GRACE_MS - 300 && over! <= 1000 + GRACE_MS, `claim over in ${over} ms`);
  // Once started, only the deadline counts.
  assert.ok(await claimRun(db.pool, id, ahead('worker-a'), null).then(() => true));
  await db.pool.query('UPDATE runs SET started_at = now() WHERE id = $1', [id]);
  const afterStart = await msUntilNextExpiry(db.pool, { unstartedAfterMs: GRACE_MS });
  assert.ok(afterStart! > 6000, `after START: ${afterStart} ms`);
});

test('a never-started claim taken back counts no expiry: a later expired call is still forgiven', async () => {
  const run = await jobWithRun({ dueInMs: 200, maxAttempts: 1 });
  // One forgiven expiry of a call already: the bound leaves room for one more.
  await db.pool.query('UPDATE runs SET expiries = $2 WHERE id = $1', [run.id, FORGIVEN_EXPIRIES - 1]);
  assert.ok((await claimRun(db.pool, run.id, ahead('worker-a'), 1))?.startPending, 'claimed ahead');
  await sleep(200 + GRACE_MS + 150);
  assert.equal((await reaper().reapBatch()).reaped, 1, 'taken back: its call never began');
  const expiries = async () =>
    (await db.pool.query<{ expiries: number }>('SELECT expiries FROM runs WHERE id = $1', [run.id])).rows[0]!
      .expiries;
  assert.equal(await expiries(), FORGIVEN_EXPIRIES - 1, 'no call was made: nothing counted');

  // The next attempt's call begins and its worker dies mid-call: that expiry is still forgiven.
  const claimed = await claimRun(db.pool, run.id, { ...ahead('worker-b'), graceMs: 0 }, 2);
  assert.equal(claimed?.startPending, false, 'claimed when due: started with its claim');
  await db.pool.query(`UPDATE runs SET claim_expires_at = now() - interval '1 second' WHERE id = $1`, [
    run.id,
  ]);
  assert.equal((await reaper().reapBatch()).reaped, 1);
  const back = await runOf(run.id);
  assert.deepEqual(
    [back.state, back.attempt, back.maxAttempts],
    ['queued', 2, 3],
    'forgiven: re-queued with its one attempt still unused',
  );
  assert.equal(await expiries(), FORGIVEN_EXPIRIES);
});

test('runs the reaper re-queues at once are handed to the other workers, not left to the claimant’s partition', async () => {
  const unstarted = await jobWithRun({ dueInMs: 200 });
  const started = await jobWithRun({ dueInMs: 200 });
  const charged = await jobWithRun({ dueInMs: 200, maxAttempts: 3 });
  assert.ok((await claimRun(db.pool, unstarted.id, ahead('worker-a'), 1))?.startPending);
  const b = await claimRun(db.pool, started.id, ahead('worker-b'), 1);
  const c = await claimRun(db.pool, charged.id, ahead('worker-b'), 1);
  assert.deepEqual(await startRuns(db.pool, 'worker-b', [b!, c!]), [true, true]);
  // worker-b's calls began and its claims expired: one forgiven, one past the bound and charged.
  await db.pool.query(`UPDATE runs SET expiries = $2 WHERE id = $1`, [charged.id, FORGIVEN_EXPIRIES]);
  await sleep(200 + GRACE_MS + 150);
  await db.pool.query(
    `UPDATE runs SET claim_expires_at = now() - interval '1 second' WHERE id = ANY($1::uuid[])`,
    [[started.id, charged.id]],
  );

  // The workers' hand-off channel, as worker.ts listens on it, and the node's peers but the claimant.
  const listener = new pg.Client({ connectionString: db.url });
  await listener.connect();
  const payloads: string[] = [];
  listener.on('notification', (n) => payloads.push(n.payload ?? ''));
  await listener.query(`LISTEN ${HANDOFF_CHANNEL}`);
  const handed: { claimedBy: string | null; runs: string[] }[] = [];
  const sent: Promise<number>[] = [];
  // The registry as the node lists it (src/node.ts): a node without the worker role is never a
  // peer, nor is the claimant.
  const registry = [
    { id: 'api-only', roles: ['api', 'leader'] },
    ...['worker-a', 'worker-b', 'worker-c'].map((id) => ({ id, roles: ['api', 'leader', 'worker'] })),
  ];
  const withHandOff = reaper({
    handOff: (messages, claimedBy) => {
      handed.push({ claimedBy, runs: messages.map((m) => `${m.runId}/${m.attempt}`).sort() });
      sent.push(handOffRuns(db.pool, messages, workersBut(registry, claimedBy)));
    },
  });
  try {
    assert.equal((await withHandOff.reapBatch()).reaped, 3);
    await Promise.all(sent);
    assert.deepEqual(
      handed.sort((x, y) => String(x.claimedBy).localeCompare(String(y.claimedBy))),
      [
        { claimedBy: 'worker-a', runs: [`${unstarted.id}/2`] },
        { claimedBy: 'worker-b', runs: [`${started.id}/2`] },
      ],
      'the forgiven runs, by claimant, each with its next attempt; the charged retry waits its backoff',
    );
    await until(() => payloads.length === 2);
    // Each worker reads only what is addressed to it: never the claimant it was taken from.
    const readBy = (worker: string) => payloads.flatMap((p) => parseHandOff(p, worker).map((m) => m.runId));
    assert.deepEqual(readBy('worker-a'), [started.id]);
    assert.deepEqual(readBy('worker-b'), [unstarted.id]);
    assert.deepEqual(readBy('worker-c'), []);
    assert.deepEqual(readBy('api-only'), []);
  } finally {
    await listener.end();
  }
});

test('a pass takes never-started runs up to their own limit, beyond the batch of runs past their deadline', async () => {
  const runs = await Promise.all(Array.from({ length: 7 }, () => jobWithRun({ dueInMs: 200 })));
  for (const run of runs) assert.ok((await claimRun(db.pool, run.id, ahead('worker-a'), 1))?.startPending);
  // One of them started, and its claim is past its deadline: a run of the first kind.
  const [late] = runs;
  const claimed = await db.pool.query(`SELECT attempt FROM runs WHERE id = $1`, [late!.id]);
  assert.deepEqual(
    await startRuns(db.pool, 'worker-a', [{ id: late!.id, attempt: claimed.rows[0].attempt as number }]),
    [true],
  );
  await sleep(200 + GRACE_MS + 150);
  await db.pool.query(`UPDATE runs SET claim_expires_at = now() - interval '1 second' WHERE id = $1`, [
    late!.id,
  ]);
  const small = reaper({ batchSize: 2, unstartedBatchSize: 4 });
  // The one past its deadline (fewer than 2), then 4 never started: 5 in one pass, and more wait.
  assert.deepEqual(await small.reapBatch(), { reaped: 5, full: true });
  assert.deepEqual(await small.reapBatch(), { reaped: 2, full: true });
  assert.deepEqual(await small.reapBatch(), { reaped: 0, full: false });
  const { rows } = await db.pool.query<{ state: string }>(
    `SELECT state FROM runs WHERE id = ANY($1::uuid[])`,
    [runs.map((r) => r.id)],
  );
  assert.deepEqual(
    rows.map((r) => r.state),
    Array(7).fill('queued'),
  );
});
