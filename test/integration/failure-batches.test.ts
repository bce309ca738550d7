import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import {
  failAttempt,
  failMany,
  releaseClaim,
  type AttemptReport,
  type Failure,
} from '../../src/store/attempts.js';
import { releaseClaims } from '../../src/store/releases.js';
import { inTransaction } from '../../src/store/db.js';
import { claimRun, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// A worker settles its failed attempts in batches (failMany, one statement) and falls back to one
// transaction per failure (failAttempt) when a batch fails. Both must write the same rows and the
// same announcements: the workers parse the retry's, and whoever consumes the dead-letter topic
// the dead letter's.

let db: TestDatabase;
const topics = { runsTopic: 'failures.runs', deadLetterTopic: 'failures.dlq' };
const NODE = 'fail-node';

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

const report = (overrides: Partial<AttemptReport> = {}): AttemptReport => ({
  outcome: 'failed',
  statusCode: 503,
  durationMs: 12.4,
  error: 'HTTP 503',
  responseExcerpt: 'unavailable',
  startedAt: new Date(Date.now() - 50),
  ...overrides,
});

/** A run of a new job (never dispatched), due a second ago (or in `dueInS`), claimed by `node`. */
async function claimedRun(
  options: { maxAttempts?: number; node?: string; dueInS?: number } = {},
): Promise<ClaimedRun> {
  const { rows } = await db.pool.query<{ id: string }>(
    `WITH job AS (
       INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms)
       VALUES ('fail-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', 5000, $1, 1000)
       RETURNING *)
     INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, date_trunc('second', now()) + $2 * interval '1 second', 'queued', max_attempts, target,
            timeout_ms, backoff_ms, backoff_multiplier, concurrency, now() + $2 * interval '1 second'
     FROM job RETURNING id`,
    [options.maxAttempts ?? 3, options.dueInS ?? -1],
  );
  const run = await claimRun(
    db.pool,
    rows[0]!.id,
    { nodeId: options.node ?? NODE, graceMs: 5000, skewToleranceMs: 0, leadMs: 5000 },
    1,
  );
  assert.ok(run, 'claimed');
  return run;
}

/** What a settled failure left: the run, its attempt record and its announcements. */
async function written(run: ClaimedRun) {
  const { rows: runs } = await db.pool.query(
    `SELECT state, attempt, max_attempts, claimed_by, claim_expires_at, last_status, last_error,
            finished_at IS NOT NULL AS finished,
            round(extract(epoch FROM not_before - now()))::int AS due_in_s
     FROM runs WHERE id = $1`,
    [run.id],
  );
  const { rows: attempts } = await db.pool.query(
    `SELECT attempt, node_id, outcome, status_code, duration_ms, error, response_excerpt,
            finished_at IS NOT NULL AS finished
     FROM run_attempts WHERE run_id = $1 ORDER BY attempt`,
    [run.id],
  );
  const { rows: letters } = await db.pool.query<{ id: string }>(
    `SELECT id, attempt, error, status_code FROM dead_letters WHERE run_id = $1`,
    [run.id],
  );
  const { rows: outbox } = await db.pool.query<{
    topic: string;
    key: string;
    payload: Record<string, unknown>;
    delay: number;
  }>(
    `SELECT topic, key, payload, round(extract(epoch FROM publish_after - now()))::int AS delay
     FROM outbox WHERE payload->>'runId' = $1 ORDER BY id`,
    [run.id],
  );
  return { runs, attempts, letters, outbox };
}

/** The written rows of `run` with placeholders for its own ids and instants, to compare two runs. */
function generic(rows: Awaited<ReturnType<typeof written>>, run: ClaimedRun) {
  const text = JSON.stringify(rows)
    .replaceAll(run.id, '<run>')
    .replaceAll(run.jobId, '<job>')
    .replaceAll(run.scheduledFor.toISOString(), '<scheduledFor>')
    // Instants of the write itself (a retry's due time, a dead letter's): their format is checked apart.
    .replace(/\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z/g, '<now>');
  const letter = rows.letters[0]?.id;
  return JSON.parse(letter ? text.replaceAll(letter, '<letter>') : text) as unknown;
}

/** Timestamps of an announcement must be what Date.prototype.toISOString writes (as JSON.stringify does). */
function assertIsoTimestamps(payload: Record<string, unknown>, keys: string[]) {
  for (const key of keys) {
    const value = payload[key];
    assert.equal(typeof value, 'string', key);
    assert.equal(new Date(value as string).toISOString(), value, `${key} as toISOString writes it`);
  }
}

test('a batch of failures writes what one transaction per failure writes: the retry and its announcement', async () => {
  const single = await claimedRun();
  const batched = await claimedRun();
  const one = await inTransaction(db.pool, (c) =>
    failAttempt(c, single, { nodeId: NODE }, report(), 60_000, topics),
  );
  const [many] = await failMany(
    db.pool,
    NODE,
    [{ run: batched, report: report(), retryDelayMs: 60_000 }],
    topics,
  );
  assert.equal(one?.state, 'queued');
  assert.equal(many?.state, 'queued');
  const a = await written(single);
  const b = await written(batched);
  assert.deepEqual(generic(b, batched), generic(a, single));
  // And what that is: queued for attempt 2 in a minute, the attempt recorded, the retry announced then.
  assert.equal(b.runs[0].state, 'queued');
  assert.equal(b.runs[0].due_in_s, 60);
  assert.equal(b.attempts[0].outcome, 'failed');
  assert.equal(b.attempts[0].response_excerpt, 'unavailable');
  assert.equal(b.outbox.length, 1);
  assert.equal(b.outbox[0]!.topic, topics.runsTopic);
  assert.equal(b.outbox[0]!.delay, 60);
  assert.equal(b.outbox[0]!.payload.attempt, 2);
  assertIsoTimestamps(b.outbox[0]!.payload, ['scheduledFor', 'notBefore']);
  assert.equal(many?.state === 'queued' && many.notBefore.toISOString(), b.outbox[0]!.payload.notBefore);
});

test('a batch of failures writes what one transaction per failure writes: the dead letter and its announcement', async () => {
  // Attempts used up, and a call that can never be made (not retryable): both dead.
  for (const [options, failure] of [
    [{ maxAttempts: 1 }, report()],
    [
      { maxAttempts: 3 },
      report({ retryable: false, statusCode: null, error: 'denied by the target policy' }),
    ],
  ] as const) {
    const single = await claimedRun(options);
    const batched = await claimedRun(options);
    const one = await inTransaction(db.pool, (c) =>
      failAttempt(c, single, { nodeId: NODE }, failure, 0, topics),
    );
    const [many] = await failMany(
      db.pool,
      NODE,
      [{ run: batched, report: failure, retryDelayMs: 0 }],
      topics,
    );
    assert.equal(one?.state, 'dead');
    assert.equal(many?.state, 'dead');
    const a = await written(single);
    const b = await written(batched);
    assert.deepEqual(generic(b, batched), generic(a, single));
    assert.equal(b.letters.length, 1);
    assert.equal(many?.state === 'dead' && many.deadLetterId, b.letters[0]!.id);
    const announcement = b.outbox.find((o) => o.topic === topics.deadLetterTopic);
    assert.ok(announcement, 'the dead letter is announced');
    assert.equal(announcement.payload.deadLetterId, b.letters[0]!.id);
    assertIsoTimestamps(announcement.payload, ['scheduledFor', 'deadAt']);
    assert.equal(b.outbox.length, 1, 'no retry is announced');
  }
});

test('a batch settles only the attempts this node still holds, each with its own report', async () => {
  const mine = await claimedRun();
  const others = await claimedRun({ node: 'other-node' });
  // Attempt 2 of a run is ours; attempt 1 of it is a stale report in the same batch.
  const retried = await claimedRun();
  await failMany(db.pool, NODE, [{ run: retried, report: report(), retryDelayMs: 0 }], topics);
  const second = await claimRun(db.pool, retried.id, { nodeId: NODE, graceMs: 5000, skewToleranceMs: 0 }, 2);
  assert.equal(second?.attempt, 2);
  const items: Failure[] = [
    { run: others, report: report({ error: 'not ours' }), retryDelayMs: 0 },
    { run: retried, report: report({ error: 'stale attempt 1' }), retryDelayMs: 0 },
    { run: mine, report: report({ error: 'mine', statusCode: 500 }), retryDelayMs: 0 },
    {
      run: second!,
      report: report({ outcome: 'timeout', error: 'attempt 2 timed out', statusCode: null }),
      retryDelayMs: 0,
    },
  ];
  const results = await failMany(db.pool, NODE, items, topics);
  assert.deepEqual(
    results.map((r) => r?.state ?? null),
    [null, null, 'queued', 'queued'],
  );
  const theirs = await written(others);
  assert.equal(theirs.runs[0].state, 'running');
  assert.equal(theirs.runs[0].claimed_by, 'other-node');
  assert.equal(theirs.attempts[0].outcome, null);
  assert.equal(theirs.outbox.length, 0);
  const ours = await written(mine);
  assert.equal(ours.runs[0].last_error, 'mine');
  assert.equal(ours.runs[0].last_status, 500);
  const both = await written(second!);
  assert.deepEqual(
    both.attempts.map((a) => [a.attempt, a.outcome, a.error]),
    [
      [1, 'failed', 'HTTP 503'],
      [2, 'timeout', 'attempt 2 timed out'],
    ],
  );
  assert.equal(both.runs[0].last_error, 'attempt 2 timed out');
  assert.deepEqual(
    both.outbox.map((o) => o.payload.attempt),
    [2, 3],
  );
});

/** What a worker reports for a claim it gives back: stopping before the call, or its call aborted. */
const handedBack = (overrides: Partial<AttemptReport> = {}): AttemptReport => ({
  outcome: 'cancelled',
  statusCode: null,
  durationMs: null,
  error: 'worker stopping before this call could end; call not made',
  responseExcerpt: null,
  ...overrides,
});

test('a batch of released claims writes what one transaction per release writes: queued again, no attempt used, announced', async () => {
  // Claimed ahead (due in 3 s: due then still, not at once) and due already (due at once).
  for (const [dueInS, report] of [
    [3, handedBack()],
    [-1, handedBack({ durationMs: 7.6, error: 'worker is stopping', startedAt: new Date(Date.now() - 20) })],
  ] as const) {
    const single = await claimedRun({ dueInS });
    const batched = await claimedRun({ dueInS });
    const one = await inTransaction(db.pool, (c) => releaseClaim(c, single, NODE, report, topics.runsTopic));
    const [many] = await releaseClaims(db.pool, NODE, [{ run: batched, report }], topics.runsTopic);
    assert.ok(one && many);
    const a = await written(single);
    const b = await written(batched);
    assert.deepEqual(generic(b, batched), generic(a, single));
    // The same announcement but for the run's own ids and instant (each run was made at its own now()).
    const own = { runId: '<run>', jobId: '<job>', notBefore: '<notBefore>' };
    assert.deepEqual({ ...many, ...own }, { ...one, ...own });
    // And what that is: queued for attempt 2 with one more attempt allowed, due when it was due.
    assert.deepEqual(
      [b.runs[0].state, b.runs[0].attempt, b.runs[0].max_attempts, b.runs[0].claimed_by],
      ['queued', 1, 4, null],
    );
    assert.equal(b.runs[0].due_in_s, Math.max(0, dueInS));
    assert.equal(b.attempts[0].outcome, 'cancelled');
    assert.equal(b.outbox.length, 1);
    assert.equal(b.outbox[0]!.payload.attempt, 2);
    assertIsoTimestamps(b.outbox[0]!.payload, ['scheduledFor', 'notBefore']);
    assert.equal(many.notBefore.toISOString(), b.outbox[0]!.payload.notBefore);
    assert.equal(many.attempt, 2);
  }
});

test('a batch releases only the claims this node still holds, each attempt with its own report', async () => {
  const mine = await claimedRun();
  const others = await claimedRun({ node: 'other-node' });
  // Attempt 2 of a run is ours; a release of its attempt 1 in the same batch is stale.
  const again = await claimedRun();
  await releaseClaims(db.pool, NODE, [{ run: again, report: handedBack() }], topics.runsTopic);
  const second = await claimRun(db.pool, again.id, { nodeId: NODE, graceMs: 5000, skewToleranceMs: 0 }, 2);
  assert.equal(second?.attempt, 2);
  const results = await releaseClaims(
    db.pool,
    NODE,
    [
      { run: others, report: handedBack({ error: 'not ours' }) },
      { run: again, report: handedBack({ error: 'stale attempt 1' }) },
      { run: mine, report: handedBack({ error: 'mine' }) },
      { run: second!, report: handedBack({ error: 'attempt 2 aborted' }) },
    ],
    topics.runsTopic,
  );
  assert.deepEqual(
    results.map((r) => r && [r.runId === mine.id ? 'mine' : 'again', r.attempt]),
    [null, null, ['mine', 2], ['again', 3]],
  );
  const theirs = await written(others);
  assert.deepEqual([theirs.runs[0].state, theirs.runs[0].claimed_by], ['running', 'other-node']);
  assert.equal(theirs.attempts[0].outcome, null);
  assert.equal(theirs.outbox.length, 0);
  const twice = await written(again);
  assert.deepEqual(
    twice.attempts.map((a: { attempt: number; error: string }) => [a.attempt, a.error]),
    [
      [1, 'worker stopping before this call could end; call not made'],
      [2, 'attempt 2 aborted'],
    ],
  );
  assert.equal(twice.runs[0].max_attempts, 5, 'two releases, two attempts more');
});
