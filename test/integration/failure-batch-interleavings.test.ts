import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, afterEach, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import { createFailureBatcher } from '../../src/execution/batching.js';
import { deleteJob, pauseJob } from '../../src/jobs/commands.js';
import { failAttempt, failMany, type AttemptReport, type FailureResult } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { forgiveExpiredClaims } from '../../src/store/releases.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';
import { claimRun, claimRuns, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { waitFor } from '../support/execution.js';

// The worker's failure batches (failMany, createFailureBatcher) against the other writers of their
// rows, on the real PostgreSQL: the reaper, a job delete, a pause holding its job while another
// worker's claim waits on a forbid job's run in the batch (a deadlock cycle when the batch's dead
// letter waited for that job's row), a job held by a command while other jobs' failures share its
// batch, odd values written as the single path writes them, a refused item, dead and replayed.

let db: TestDatabase;
let pool: pg.Pool;
const topics = { runsTopic: 'review.runs', deadLetterTopic: 'review.dlq' };
const NODE = 'review-node';
const claimOptions = { nodeId: NODE, graceMs: 5000, skewToleranceMs: 0 };

before(async () => {
  db = await createTestDatabase();
  pool = new pg.Pool({ connectionString: db.url, max: 12, options: '-c TimeZone=UTC' });
  pool.on('error', () => undefined);
});
after(async () => {
  await pool.end();
  await db.drop();
});

const report = (overrides: Partial<AttemptReport> = {}): AttemptReport => ({
  outcome: 'failed',
  statusCode: 503,
  durationMs: 12,
  error: 'HTTP 503',
  responseExcerpt: 'unavailable',
  startedAt: new Date(Date.now() - 50),
  ...overrides,
});

async function makeJob(options: { maxAttempts?: number; concurrency?: string } = {}): Promise<string> {
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, concurrency, next_run_at)
     VALUES ('review-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', 5000, $1, 1000, $2,
             now() + interval '1 hour')
     RETURNING id`,
    [options.maxAttempts ?? 3, options.concurrency ?? 'allow'],
  );
  return rows[0]!.id;
}

/** A queued run of `jobId`; `dueInMs` from now; `attempt` > 0 makes it a retry (started). */
async function makeRun(
  jobId: string,
  options: { id?: string; dueInMs?: number; attempt?: number; scheduledFor?: string } = {},
): Promise<string> {
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO runs (id, job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before, started_at)
     SELECT $2, j.id, coalesce($5::timestamptz, clock_timestamp() + $3 * interval '1 millisecond'),
            'queued', $4, j.max_attempts + $4, j.target, j.timeout_ms, j.backoff_ms, j.backoff_multiplier,
            j.concurrency, now() + $3 * interval '1 millisecond', CASE WHEN $4 > 0 THEN now() END
     FROM jobs j WHERE j.id = $1
     RETURNING id`,
    [
      jobId,
      options.id ?? randomUUID(),
      options.dueInMs ?? -1000,
      options.attempt ?? 0,
      options.scheduledFor ?? null,
    ],
  );
  return rows[0]!.id;
}

async function claimed(jobId: string, options: Parameters<typeof makeRun>[1] = {}): Promise<ClaimedRun> {
  const id = await makeRun(jobId, options);
  const run = await claimRun(pool, id, claimOptions, null);
  assert.ok(run, 'claimed');
  return run;
}

/** Waits until a statement whose text contains `fragment` waits for a lock. */
async function untilWaiting(...fragments: string[]): Promise<void> {
  await waitFor(
    `a statement with "${fragments.join('" or "')}" waiting for a lock`,
    async () => {
      // pg_stat_activity keeps the first track_activity_query_size (1 kB) of a statement's text.
      const { rows } = await pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
       WHERE datname = current_database() AND wait_event_type = 'Lock'
         AND EXISTS (SELECT 1 FROM unnest($1::text[]) f WHERE position(f in query) > 0)`,
        [fragments],
      );
      return rows[0]!.n > 0;
    },
    10_000,
    10,
  );
}

/** Open transactions still to end (a failed test must not leave its locks to the next). */
const holders = new Set<(how?: 'ROLLBACK') => Promise<void>>();
afterEach(async () => {
  for (const end of holders) await end('ROLLBACK');
  holders.clear();
});

async function openTransaction() {
  const client = await pool.connect();
  await client.query('BEGIN');
  let open = true;
  const end = async (how: 'COMMIT' | 'ROLLBACK' = 'COMMIT') => {
    if (!open) return;
    open = false;
    await client.query(how);
    client.release();
  };
  holders.add(end);
  return { client, end };
}

/** Settles `promise` into a value or an error, with how long it took from `since`. */
async function outcome<T>(promise: Promise<T>, since: number) {
  try {
    const value = await promise;
    return {
      value,
      error: undefined as (Error & { code?: string }) | undefined,
      ms: performance.now() - since,
    };
  } catch (err) {
    return { value: undefined, error: err as Error & { code?: string }, ms: performance.now() - since };
  }
}

async function rowsOf(runId: string) {
  const run = (
    await pool.query(
      `SELECT state, attempt, max_attempts, claimed_by, last_status, last_error, not_before, finished_at, started_at
       FROM runs WHERE id = $1`,
      [runId],
    )
  ).rows[0];
  const attempts = (
    await pool.query(
      `SELECT attempt, outcome, status_code, duration_ms, error, response_excerpt, started_at, finished_at IS NOT NULL AS finished
       FROM run_attempts WHERE run_id = $1 ORDER BY attempt`,
      [runId],
    )
  ).rows;
  const letters = (
    await pool.query(
      `SELECT id, attempt, error, status_code, created_at, replayed_at FROM dead_letters WHERE run_id = $1 ORDER BY created_at`,
      [runId],
    )
  ).rows;
  const outbox = (
    await pool.query<{ topic: string; key: string; payload: Record<string, unknown>; publish_after: Date }>(
      `SELECT topic, key, payload, publish_after FROM outbox WHERE payload->>'runId' = $1 ORDER BY id`,
      [runId],
    )
  ).rows;
  return { run, attempts, letters, outbox };
}

// 1. The reaper (leader) takes an expired claim back while the worker's batch settles it.
for (const reaperEnds of ['COMMIT', 'ROLLBACK'] as const) {
  test(`a batch that waited on the reaper's forgiveness of an expired claim (${reaperEnds}) judges the committed row`, async () => {
    const job = await makeJob();
    const x = await claimed(job);
    const y = await claimed(job);
    await pool.query(`UPDATE runs SET claim_expires_at = now() - interval '1 second' WHERE id = $1`, [x.id]);
    // What Reaper.reapBatch does for x, held open: locked (SELECT_EXPIRED), forgiven (re-queued, uncharged).
    const reaper = await openTransaction();
    await reaper.client.query(`SELECT id FROM runs WHERE id = $1 FOR UPDATE`, [x.id]);
    const [forgiven] = await forgiveExpiredClaims(
      reaper.client,
      [{ run: x, error: 'claim expired' }],
      2,
      topics.runsTopic,
    );
    assert.ok(forgiven);
    const batch = failMany(
      pool,
      NODE,
      [
        { run: x, report: report(), retryDelayMs: 60_000 },
        { run: y, report: report(), retryDelayMs: 60_000 },
      ],
      topics,
    );
    await untilWaiting('AS i (id, attempt, delay');
    await reaper.end(reaperEnds);
    const [ofX, ofY] = await batch;
    assert.equal(ofY?.state, 'queued');
    const xs = await rowsOf(x.id);
    if (reaperEnds === 'COMMIT') {
      // Re-queued by the reaper, uncharged: the batch must settle nothing for x.
      assert.equal(ofX, null, 'the stale claim settles nothing');
      assert.equal(xs.run.state, 'queued');
      assert.equal(xs.run.max_attempts, x.maxAttempts + 1, 'the expiry used up no attempt');
      assert.deepEqual(
        xs.attempts.map((a) => [a.attempt, a.outcome]),
        [[1, 'expired']],
      );
      assert.equal(xs.outbox.length, 1, "one announcement of attempt 2 (the reaper's), not two");
      assert.equal(xs.outbox[0]!.payload.attempt, 2);
      assert.ok(
        Math.abs(new Date(xs.run.not_before).getTime() - Date.now()) < 5_000,
        'due at once, not in a minute',
      );
    } else {
      assert.equal(ofX?.state, 'queued');
      assert.deepEqual(
        xs.attempts.map((a) => [a.attempt, a.outcome]),
        [[1, 'failed']],
      );
      assert.equal(xs.outbox.length, 1);
    }
  });
}

// 2. A job DELETE (the real command) while a batch that buries one of its runs waits on the job row.
test('a job delete racing a batch that buries one of its runs: neither deadlocks, the delete cascades', async () => {
  const doomed = await makeJob({ maxAttempts: 1 });
  const other = await makeJob();
  const dying = await claimed(doomed);
  const retrying = await claimed(other);
  // Something holds the job row as a pause or an edit does (findJob ... FOR UPDATE).
  const holder = await openTransaction();
  await holder.client.query('SELECT 1 FROM jobs WHERE id = $1 FOR UPDATE', [doomed]);
  const t0 = performance.now();
  const batch = outcome(
    failMany(
      pool,
      NODE,
      [
        { run: dying, report: report(), retryDelayMs: 0 },
        { run: retrying, report: report(), retryDelayMs: 0 },
      ],
      topics,
    ),
    t0,
  );
  await untilWaiting('INSERT INTO dead_letters', 'AS i (id, attempt, delay');
  const deletion = outcome(deleteJob(pool, { id: doomed }), t0);
  await sleep(200);
  const released = performance.now();
  await holder.end();
  const [b, d] = await Promise.all([batch, deletion]);
  assert.equal(b.error, undefined, `the batch failed: ${b.error?.message} (${b.error?.code})`);
  assert.equal(d.error, undefined, `the delete failed: ${d.error?.message} (${d.error?.code})`);
  assert.equal(d.value, true);
  assert.ok(
    b.ms - (released - t0) < 900,
    `the batch waited ${Math.round(b.ms - (released - t0))} ms after the job was let go`,
  );
  assert.equal(b.value![0]?.state, 'dead');
  assert.equal(b.value![1]?.state, 'queued');
  const gone = await rowsOf(dying.id);
  assert.equal(gone.run, undefined, 'the run went with its job');
  assert.deepEqual(gone.letters, [], 'its dead letter too');
});

// 3. A pause (the real command) holding its job's row while it yields to another worker's claim batch,
//    which waits on this worker's failure batch through the forbid index, which waits on the job row.
for (const mode of ['batch', 'one transaction per failure'] as const) {
  test(`pause → claim batch → failure batch (${mode}): the cycle resolves without a deadlock error, in well under a second`, async () => {
    const paused = await makeJob({ maxAttempts: 1 });
    const forbid = await makeJob({ concurrency: 'forbid' });
    const dying = await claimed(paused);
    const forbidRunning = await claimed(forbid);
    // A run of the paused job claimed ahead by another worker (not begun: the pause withdraws it),
    // and a retry of the forbid job waiting its turn. Ids chosen so a claim batch locks `ahead` first.
    const ahead = await makeRun(paused, {
      id: `00000000-0000-4000-8000-${randomUUID().slice(-12)}`,
      dueInMs: 3000,
    });
    const retry = await makeRun(forbid, {
      id: `ffffffff-0000-4000-8000-${randomUUID().slice(-12)}`,
      attempt: 1,
    });
    const holder = await openTransaction();
    await holder.client.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE', [ahead]);
    const t0 = performance.now();
    // The pause locks the job, then yields to `ahead`, again and again (keeping the job row).
    const pause = outcome(
      pauseJob(pool, { id: paused }, { runsTopic: topics.runsTopic, misfireThresholdMs: 5000 }),
      t0,
    );
    await untilWaiting('started_at IS NULL');
    const failures: Promise<(FailureResult | null)[]> =
      mode === 'batch'
        ? // Through the worker's batcher: the retry in one statement, the burial apart from it.
          (() => {
            const batcher = createFailureBatcher(pool, NODE, topics);
            return Promise.all(
              [dying, forbidRunning].map((run) => batcher.add({ run, report: report(), retryDelayMs: 0 })),
            );
          })()
        : Promise.all(
            [dying, forbidRunning].map((run) =>
              inTransaction(pool, (c) => failAttempt(c, run, { nodeId: NODE }, report(), 0, topics)),
            ),
          );
    const settled = outcome(failures, t0);
    await untilWaiting('INSERT INTO dead_letters', 'AS i (id, attempt, delay');
    // Another worker's claim batch: `ahead` (held above), then the forbid retry.
    const claim = outcome(
      claimRuns(
        pool,
        [
          { runId: ahead, expectedAttempt: null },
          { runId: retry, expectedAttempt: null },
        ],
        { nodeId: 'other-node', graceMs: 5000, skewToleranceMs: 0, leadMs: 5000 },
      ),
      t0,
    );
    await untilWaiting('AS c (id, expected)');
    await sleep(100);
    const released = performance.now() - t0;
    await holder.end();
    const [p, f, c] = await Promise.all([pause, settled, claim]);
    const report_ = {
      pause: p.error ? `${p.error.code} ${p.error.message}` : `ok after ${Math.round(p.ms - released)} ms`,
      failures: f.error ? `${f.error.code} ${f.error.message}` : `ok after ${Math.round(f.ms - released)} ms`,
      claim: c.error ? `${c.error.code} ${c.error.message}` : `ok after ${Math.round(c.ms - released)} ms`,
    };
    assert.ok(!p.error && !f.error && !c.error, `a side failed: ${JSON.stringify(report_)}`);
    assert.ok(
      Math.max(p.ms, f.ms, c.ms) - released < 900,
      `waited up to deadlock_timeout or beyond: ${JSON.stringify(report_)}`,
    );
  });
}

// 4. What consumers of both topics read, and the rows, for awkward values: the batch and the single path.
test('odd values: the batch writes what one transaction per failure writes, instant for instant', async () => {
  const cases: [string, Partial<AttemptReport>, number][] = [
    ['NULL text', { error: 'NULL', responseExcerpt: 'NULL' }, 3],
    ['quotes, braces, backslash', { error: 'a"b\\c{d},e\'f', responseExcerpt: '{"x":[1,2]}\\' }, 3],
    ['NUL and emoji', { error: 'x\u0000y 😀', responseExcerpt: '\u0000😀' }, 1],
    [
      'connection error',
      {
        outcome: 'failed',
        statusCode: null,
        durationMs: null,
        error: 'ECONNREFUSED',
        responseExcerpt: null,
        startedAt: undefined,
      },
      1,
    ],
    [
      'timeout',
      { outcome: 'timeout', statusCode: null, error: 'timed out after 5000 ms', responseExcerpt: null },
      3,
    ],
    ['empty strings', { error: '', responseExcerpt: '' }, 1],
  ];
  for (const [name, overrides, maxAttempts] of cases) {
    const job = await makeJob({ maxAttempts });
    // A manual trigger's scheduled_for has microseconds; this one sits at the end of a second.
    const sched = (i: number) => `2031-01-0${i} 23:59:59.999999+00`;
    const single = await claimed(job, { scheduledFor: sched(1) });
    const batched = await claimed(job, { scheduledFor: sched(2) });
    const failure = report(overrides);
    await inTransaction(pool, (c) => failAttempt(c, single, { nodeId: NODE }, failure, 1234, topics));
    await failMany(pool, NODE, [{ run: batched, report: failure, retryDelayMs: 1234 }], topics);
    const a = await rowsOf(single.id);
    const b = await rowsOf(batched.id);
    const strip = (rows: Awaited<ReturnType<typeof rowsOf>>, run: ClaimedRun) => {
      assert.equal(rows.outbox.length, 1, `${name}: one announcement`);
      const o = rows.outbox[0]!;
      const p = { ...o.payload };
      // Instants: what the consumer reads must be what the rows say (Date as pg parses it, toISOString).
      assert.equal(p.scheduledFor, run.scheduledFor.toISOString(), `${name}: scheduledFor`);
      if ('notBefore' in p) {
        assert.equal(p.notBefore, new Date(rows.run.not_before).toISOString(), `${name}: notBefore`);
        assert.ok(
          Math.abs(o.publish_after.getTime() - new Date(rows.run.not_before).getTime()) < 1,
          `${name}: publish_after`,
        );
      }
      if ('deadAt' in p) {
        assert.equal(p.deadAt, new Date(rows.letters[0].created_at).toISOString(), `${name}: deadAt`);
        assert.equal(p.deadLetterId, rows.letters[0].id);
      }
      for (const k of ['scheduledFor', 'notBefore', 'deadAt', 'runId', 'jobId', 'deadLetterId']) delete p[k];
      return {
        payload: p,
        topic: o.topic,
        run: {
          ...rows.run,
          not_before: undefined,
          finished_at: rows.run.finished_at !== null,
          started_at: undefined,
        },
        attempts: rows.attempts.map((x) => ({ ...x, started_at: undefined })),
        letters: rows.letters.map((l) => ({ ...l, id: undefined, created_at: undefined })),
      };
    };
    assert.deepEqual(strip(b, batched), strip(a, single), name);
  }
});

// 5. A batch that fails as a whole (one run the database refuses): the others settle once each.
test('a batch refused for one run falls back item by item: the others settle once, the refused one rejects', async () => {
  const job = await makeJob({ maxAttempts: 1 });
  const retried = await claimed(await makeJob());
  const poison = await claimed(job);
  const fine = await claimed(job);
  await pool.query(`
    CREATE FUNCTION review_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF NEW.run_id = '${poison.id}' THEN RAISE EXCEPTION 'refused by the review trigger'; END IF;
      RETURN NEW;
    END $$;
    CREATE TRIGGER review_refuse BEFORE INSERT ON dead_letters FOR EACH ROW EXECUTE FUNCTION review_refuse();`);
  try {
    const batcher = createFailureBatcher(pool, NODE, topics);
    const results = await Promise.allSettled(
      [retried, poison, fine].map((run) => batcher.add({ run, report: report(), retryDelayMs: 0 })),
    );
    const [first, second, third] = results as [
      PromiseSettledResult<FailureResult | null>,
      PromiseSettledResult<FailureResult | null>,
      PromiseSettledResult<FailureResult | null>,
    ];
    assert.equal(first.status === 'fulfilled' && first.value?.state, 'queued');
    assert.equal(second.status, 'rejected');
    assert.equal(third.status === 'fulfilled' && third.value?.state, 'dead');
    assert.equal((await rowsOf(retried.id)).outbox.length, 1);
    assert.equal((await rowsOf(fine.id)).outbox.length, 1);
    assert.equal((await rowsOf(fine.id)).letters.length, 1);
    const p = await rowsOf(poison.id);
    assert.equal(p.run.state, 'running', 'nothing written for the refused run');
    assert.deepEqual([p.outbox.length, p.letters.length, p.attempts[0].outcome], [0, 0, null]);
  } finally {
    await pool.query('DROP TRIGGER review_refuse ON dead_letters; DROP FUNCTION review_refuse();');
  }
});

// 6. Dead, replayed, dead again through the batch: a letter and an announcement per death.
test('dead, replayed and dead again through batches: two letters, one open, two announcements', async () => {
  const job = await makeJob({ maxAttempts: 1 });
  const first = await claimed(job);
  const [died] = await failMany(
    pool,
    NODE,
    [{ run: first, report: report() }].map((i) => ({ ...i, retryDelayMs: 0 })),
    topics,
  );
  assert.equal(died?.state, 'dead');
  const replayed = await replayDeadLetter(pool, died.state === 'dead' ? died.deadLetterId : '', topics);
  assert.equal(replayed?.attempt, 2);
  const second = await claimRun(pool, first.id, claimOptions, 2);
  assert.equal(second?.attempt, 2);
  const [again] = await failMany(
    pool,
    NODE,
    [{ run: second!, report: report({ statusCode: 500 }), retryDelayMs: 0 }],
    topics,
  );
  assert.equal(again?.state, 'dead');
  const rows = await rowsOf(first.id);
  assert.equal(rows.letters.length, 2);
  assert.deepEqual(
    rows.letters.map((l) => [l.attempt, l.replayed_at !== null]),
    [
      [1, true],
      [2, false],
    ],
  );
  const dlq = rows.outbox.filter((o) => o.topic === topics.deadLetterTopic);
  assert.deepEqual(
    dlq.map((o) => [o.payload.deadLetterId, o.payload.attempt, o.payload.statusCode]),
    [
      [rows.letters[0].id, 1, 503],
      [rows.letters[1].id, 2, 500],
    ],
  );
});

// 7. Head of line: a lock on one job's row (a pause or an edit holds it FOR UPDATE while it runs)
//    holds up the failures of every other job in the same batch; one transaction per failure did not.
test('a failure of one job is written while another job of its batch is locked by a pause or an edit', async () => {
  const locked = await makeJob({ maxAttempts: 1 });
  const dying = await claimed(locked);
  const bystander = await claimed(await makeJob());
  const holder = await openTransaction();
  await holder.client.query('SELECT 1 FROM jobs WHERE id = $1 FOR UPDATE', [locked]);
  const batcher = createFailureBatcher(pool, NODE, topics);
  const t0 = performance.now();
  const both = [dying, bystander].map((run) => batcher.add({ run, report: report(), retryDelayMs: 0 }));
  try {
    await waitFor(
      "the bystander's failure written",
      async () => (await rowsOf(bystander.id)).run.state === 'queued',
      1000,
      10,
    );
  } finally {
    await holder.end();
    await Promise.all(both);
  }
  assert.ok(performance.now() - t0 < 1000);
});
