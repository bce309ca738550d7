import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, afterEach, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import { runAttempt, WorkerStoppingError, type AttemptContext } from '../../src/execution/attempt.js';
import { createReleaseBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { pauseJob } from '../../src/jobs/commands.js';
import type { RunMessage } from '../../src/model.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { AttemptReport } from '../../src/store/attempts.js';
import { withdrawFutureRuns } from '../../src/store/jobs.js';
import type { Connections } from '../../src/store/pool-share.js';
import { releaseClaims } from '../../src/store/releases.js';
import { claimRun, type ClaimedRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { uniqueId } from '../support/env.js';
import {
  attemptsOf,
  insertJob,
  nextWholeSecond,
  oncePerMinuteAt,
  runsOf,
  untilWaitingForLocks,
  waitFor,
} from '../support/execution.js';
import { integrationFixture } from '../support/fixture.js';

// Review of baf27dc (a stopping worker hands back its runs claimed ahead at the drain's start, in
// batches: RELEASE_MANY, createReleaseBatcher, no `replace` step for an aborted run) against the
// other writers of the same rows, on the real PostgreSQL: a pause committing while the release
// batch holds its runs (either order), between the release and another worker's claim, a release
// batch whose commit's answer is lost, and a `replace` run handed back while an older one runs.

let db: TestDatabase;
let pool: pg.Pool;
const topics = { runsTopic: 'review.runs', deadLetterTopic: 'review.dlq' };
const NODE = 'stopping-node';
const OTHER = 'other-node';
const claimOptions = (nodeId: string) => ({ nodeId, graceMs: 5000, skewToleranceMs: 0, leadMs: 5000 });
const commandOptions = { runsTopic: topics.runsTopic, misfireThresholdMs: 5000 };

before(async () => {
  db = await createTestDatabase();
  pool = new pg.Pool({ connectionString: db.url, max: 12, options: '-c TimeZone=UTC' });
  pool.on('error', () => undefined);
});
after(async () => {
  await pool.end();
  await db.drop();
});

/** What attempt.ts reports for a run the drain aborted before its call. */
const stopping: AttemptReport = {
  outcome: 'cancelled',
  statusCode: null,
  durationMs: null,
  error: 'worker stopping before this call could end; call not made',
  responseExcerpt: null,
};

async function makeJob(options: { concurrency?: string; timeoutMs?: number } = {}): Promise<string> {
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, concurrency, next_run_at)
     VALUES ('review-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', $1, 1, 1000, $2,
             now() + interval '1 hour')
     RETURNING id`,
    [options.timeoutMs ?? 30_000, options.concurrency ?? 'allow'],
  );
  return rows[0]!.id;
}

/** A scheduled, queued, never-claimed run of `jobId` due in `dueInMs` (scheduled_for = not_before). */
async function makeRun(jobId: string, dueInMs: number): Promise<string> {
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO runs (id, job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT $2, j.id, now() + $3 * interval '1 millisecond', 'queued', 0, j.max_attempts, j.target,
            j.timeout_ms, j.backoff_ms, j.backoff_multiplier, j.concurrency, now() + $3 * interval '1 millisecond'
     FROM jobs j WHERE j.id = $1
     RETURNING id`,
    [jobId, randomUUID(), dueInMs],
  );
  return rows[0]!.id;
}

/** A run of `jobId` due in `dueInMs` claimed by `node` (ahead of its time when dueInMs > 0). */
async function claimed(jobId: string, dueInMs: number, node = NODE): Promise<ClaimedRun> {
  const run = await claimRun(pool, await makeRun(jobId, dueInMs), claimOptions(node), 1);
  assert.ok(run, 'claimed');
  return run;
}

async function rowOf(runId: string) {
  const { rows } = await pool.query<{
    state: string;
    attempt: number;
    max_attempts: number;
    claimed_by: string | null;
    started: boolean;
    reason: string | null;
  }>(
    `SELECT state, attempt, max_attempts, claimed_by, started_at IS NOT NULL AS started, reason
     FROM runs WHERE id = $1`,
    [runId],
  );
  return rows[0] ?? null;
}

async function outboxOf(runId: string): Promise<number[]> {
  const { rows } = await pool.query<{ attempt: number }>(
    `SELECT (payload->>'attempt')::int AS attempt FROM outbox WHERE payload->>'runId' = $1 ORDER BY id`,
    [runId],
  );
  return rows.map((r) => r.attempt);
}

async function attemptOutcomes(runId: string): Promise<(string | null)[]> {
  const { rows } = await pool.query<{ outcome: string | null }>(
    `SELECT outcome FROM run_attempts WHERE run_id = $1 ORDER BY attempt`,
    [runId],
  );
  return rows.map((r) => r.outcome);
}

/** Open transactions still to end (a failed test must not leave its locks to the next). */
const holders = new Set<pg.PoolClient>();
afterEach(async () => {
  for (const c of holders) {
    await c.query('ROLLBACK').catch(() => undefined);
    c.release();
  }
  holders.clear();
});

async function begin(): Promise<pg.PoolClient> {
  const c = await pool.connect();
  holders.add(c);
  await c.query('BEGIN');
  return c;
}

async function commit(c: pg.PoolClient): Promise<void> {
  await c.query('COMMIT');
  holders.delete(c);
  c.release();
}

test('a pause waiting for a release batch withdraws the run handed back ahead of its time (never claimed again), and leaves the due one to run', async () => {
  const job = await makeJob();
  const ahead = await claimed(job, 3_000); // claimed ahead: started_at NULL
  const due = await claimed(job, -1_000); // due already: started by its claim
  assert.deepEqual([ahead.startPending, due.startPending], [true, false]);
  // The batch's transaction holds both runs (as its statement does while it runs).
  const batch = await begin();
  const released = await releaseClaims(
    batch,
    NODE,
    [
      { run: ahead, report: stopping },
      { run: due, report: stopping },
    ],
    topics.runsTopic,
  );
  assert.ok(released[0] && released[1], 'both handed back');
  const pausing = pauseJob(pool, { id: job }, commandOptions);
  await untilWaitingForLocks(pool, { fragment: 'FOR UPDATE', timeoutMs: 10_000, everyMs: 5 });
  await commit(batch);
  const paused = await pausing;
  assert.equal(paused?.enabled, false);
  // Ahead of its time when paused: withdrawn, and the hand-off's claim elsewhere finds nothing.
  assert.equal(await rowOf(ahead.id), null, 'the run handed back ahead of its time is withdrawn');
  assert.equal(await claimRun(pool, ahead.id, claimOptions(OTHER), released[0]!.attempt), null);
  // Due before the pause: still owed, claimed by the other worker for its next attempt, and due.
  const other = await claimRun(pool, due.id, claimOptions(OTHER), released[1]!.attempt);
  assert.ok(other, 'the due run is still owed after the pause');
  assert.equal(other.attempt, 2);
  assert.ok(other.notBefore.getTime() >= due.notBefore.getTime());
});

test('a release batch waiting for a pause that withdrew one of its runs writes nothing for it: no announcement, no hand-off', async () => {
  const job = await makeJob();
  const ahead = await claimed(job, 3_000);
  const due = await claimed(job, -1_000);
  const command = await begin();
  await command.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [job]);
  await withdrawFutureRuns(command, job);
  const releasing = releaseClaims(
    pool,
    NODE,
    [
      { run: ahead, report: stopping },
      { run: due, report: stopping },
    ],
    topics.runsTopic,
  );
  await untilWaitingForLocks(pool, { fragment: 'released AS', timeoutMs: 10_000, everyMs: 5 });
  await commit(command);
  const [forAhead, forDue] = await releasing;
  assert.equal(forAhead, null, 'withdrawn meanwhile: nothing to hand over');
  assert.ok(forDue, 'the due run is handed back');
  assert.equal(await rowOf(ahead.id), null);
  assert.deepEqual(await outboxOf(ahead.id), [], 'no announcement of a withdrawn run');
  assert.deepEqual(await outboxOf(due.id), [2]);
  assert.equal((await rowOf(due.id))?.state, 'queued');
});

test('a release batch whose commit answer is lost falls back one by one and writes nothing twice; the runs are claimable at once, not left claimed', async () => {
  const job = await makeJob();
  const ahead = await claimed(job, 3_000);
  const due = await claimed(job, -1_000);
  let lost = 0;
  // The pool as the worker uses it, but the answer to the batch statement is lost after it committed.
  const lossy: Connections = {
    query: (async (...args: unknown[]) => {
      const first = args[0] as { name?: string } | string;
      const result = await (pool.query as (...a: unknown[]) => Promise<unknown>).apply(pool, args);
      if (typeof first === 'object' && first.name === 'helios-release-many') {
        lost += 1;
        throw new Error('Connection terminated unexpectedly');
      }
      return result;
    }) as pg.Pool['query'],
    connect: pool.connect.bind(pool) as pg.Pool['connect'],
  };
  const releases = createReleaseBatcher(lossy, NODE, topics.runsTopic);
  const results = await Promise.all([
    releases.add({ run: ahead, report: stopping }),
    releases.add({ run: due, report: stopping }),
  ]);
  assert.equal(lost, 1, 'one batch statement, committed');
  // The fallback finds the claims gone (the batch did commit): no second write, no hand-off.
  assert.deepEqual(results, [null, null]);
  for (const run of [ahead, due]) {
    const row = await rowOf(run.id);
    assert.deepEqual(
      [row?.state, row?.attempt, row?.max_attempts, row?.claimed_by],
      ['queued', 1, 2, null],
      'released once, one attempt more',
    );
    assert.deepEqual(await outboxOf(run.id), [2], 'announced once');
    assert.deepEqual(await attemptOutcomes(run.id), ['cancelled']);
    const next = await claimRun(pool, run.id, claimOptions(OTHER), 2);
    assert.ok(next, 'another worker claims it at once (its announcement is still in the outbox)');
  }
});

test('a release batch that fails before writing is retried one by one: each claim handed back once, with its announcement', async () => {
  const job = await makeJob();
  const ahead = await claimed(job, 3_000);
  const due = await claimed(job, -1_000);
  const failing: Connections = {
    query: (async (...args: unknown[]) => {
      const first = args[0] as { name?: string } | string;
      if (typeof first === 'object' && first.name === 'helios-release-many') {
        throw Object.assign(new Error('deadlock detected'), { code: '40P01' });
      }
      return (pool.query as (...a: unknown[]) => Promise<unknown>).apply(pool, args);
    }) as pg.Pool['query'],
    connect: pool.connect.bind(pool) as pg.Pool['connect'],
  };
  const releases = createReleaseBatcher(failing, NODE, topics.runsTopic);
  const [a, d] = await Promise.all([
    releases.add({ run: ahead, report: stopping }),
    releases.add({ run: due, report: stopping }),
  ]);
  assert.deepEqual(
    [a?.runId, a?.attempt, d?.runId, d?.attempt],
    [ahead.id, 2, due.id, 2],
    'each handed back by the fallback',
  );
  // Handed back ahead of its time, it is still due when it was due (never called early elsewhere).
  assert.equal(a!.notBefore.getTime(), ahead.notBefore.getTime());
  for (const run of [ahead, due]) {
    assert.deepEqual(await outboxOf(run.id), [2]);
    assert.deepEqual((await rowOf(run.id))?.max_attempts, 2);
  }
});

/** A context as the worker's, on the real database, with a recording executor (no HTTP). */
function context(nodeId: string, calls: string[], handedOff: RunMessage[]): AttemptContext {
  const releases = createReleaseBatcher(pool, nodeId, topics.runsTopic);
  const executor = {
    execute: async (run: ClaimedRun, signal: AbortSignal) => {
      if (signal.aborted) {
        return {
          outcome: 'cancelled',
          statusCode: null,
          durationMs: 0,
          error: 'aborted',
          responseExcerpt: null,
        };
      }
      calls.push(`${nodeId}:${run.id}:${run.attempt}`);
      return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: 'ok' };
    },
  } as unknown as HttpExecutor;
  return {
    pool,
    nodeId,
    executor,
    topics,
    clock: new DbClock(),
    start: async () => true,
    complete: async (run, report) => {
      const { rowCount } = await pool.query(
        `UPDATE runs SET state = 'succeeded', finished_at = now(), claimed_by = NULL
         WHERE id = $1 AND attempt = $2 AND claimed_by = $3 AND state = 'running'`,
        [run.id, run.attempt, nodeId],
      );
      void report;
      return rowCount === 1;
    },
    release: (run, report) => releases.add({ run, report }),
    handOff: (messages) => handedOff.push(...messages),
    logger: silentLogger,
    metrics: createMetrics(nodeId),
  };
}

test('replace: a newer run the drain hands back does not replace the older one still running elsewhere; whoever calls it does', async () => {
  const job = await makeJob({ concurrency: 'replace', timeoutMs: 5_000 });
  const older = await claimed(job, -2_000, 'node-x'); // its call underway on node x
  const newer = await claimed(job, -1_000, NODE);
  const calls: string[] = [];
  const handedOff: RunMessage[] = [];
  const aborted = new AbortController();
  aborted.abort(new WorkerStoppingError('worker is stopping'));
  await runAttempt(context(NODE, calls, handedOff), newer, aborted.signal);
  assert.deepEqual(calls, [], 'no call by the stopping worker');
  assert.deepEqual(
    handedOff.map((m) => [m.runId, m.attempt]),
    [[newer.id, 2]],
  );
  const x = await rowOf(older.id);
  assert.deepEqual(
    [x?.state, x?.claimed_by],
    ['running', 'node-x'],
    'the older call is not cut for a run not called',
  );
  // Another worker takes the hand-off: its attempt replaces the older run, then calls.
  const taken = await claimRun(pool, newer.id, claimOptions(OTHER), 2);
  assert.ok(taken);
  await runAttempt(context(OTHER, calls, []), taken, new AbortController().signal);
  assert.deepEqual(calls, [`${OTHER}:${newer.id}:2`]);
  const replaced = await rowOf(older.id);
  assert.deepEqual([replaced?.state, replaced?.reason], ['failed', 'replaced']);
  assert.equal((await rowOf(newer.id))?.state, 'succeeded');
});

test("a pause between the release and the other worker's claim: the handed-back run is withdrawn if not yet due, still claimable if due", async () => {
  const job = await makeJob();
  const ahead = await claimed(job, 2_000);
  const due = await claimed(job, -500);
  const [a, d] = await releaseClaims(
    pool,
    NODE,
    [
      { run: ahead, report: stopping },
      { run: due, report: stopping },
    ],
    topics.runsTopic,
  );
  assert.ok(a && d);
  await pauseJob(pool, { id: job }, commandOptions);
  assert.equal(await claimRun(pool, ahead.id, claimOptions(OTHER), a.attempt), null, 'withdrawn');
  assert.equal(await rowOf(ahead.id), null);
  const other = await claimRun(pool, due.id, claimOptions(OTHER), d.attempt);
  assert.ok(other, 'due before the pause: still runs');
  await sleep(0);
});

test(
  "a worker stopped with runs claimed ahead hands them back before they are due, a pause during its drain withdraws its jobs' runs, the others are called once, on time, by a peer",
  { timeout: 150_000 },
  async () => {
    const fx = await integrationFixture();
    try {
      const leader = fx.spawn('rev-leader', { HELIOS_ROLES: 'scheduler' });
      await leader.waitForLog((l) => l.msg === 'became leader', 30_000);
      // The peer consumes another topic: it gets these runs only through the hand-off (or ≥ 2 s
      // late, by polling).
      const peer = fx.spawn('rev-peer', {
        HELIOS_ROLES: 'worker',
        HELIOS_KAFKA_TOPIC: `${fx.topic}.quiet`,
        HELIOS_KAFKA_DLQ_TOPIC: `${fx.topic}.quiet.dlq`,
        HELIOS_KAFKA_GROUP: `${fx.topic}.quiet.workers`,
      });
      const stopping = fx.spawn('rev-stopping', { HELIOS_ROLES: 'worker', HELIOS_CLAIM_LEAD_MS: '3000' });
      await peer.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
      await stopping.waitForLog((l) => l.msg === 'joined consumer group', 30_000);

      const at = await nextWholeSecond(fx.db.pool, 4500);
      // The default 30 s timeout: no call can end before the drain's deadline (9 s).
      const job = (kind: string) =>
        insertJob(fx.db.pool, {
          name: `rev-${kind}-${uniqueId()}`,
          schedule: oncePerMinuteAt(at),
          target: { url: `${fx.target.url}/ok` },
          nextRunAt: at,
          timeoutMs: 30_000,
          maxAttempts: 1,
        });
      const kept = await Promise.all(Array.from({ length: 6 }, () => job('kept')));
      const paused = await Promise.all(Array.from({ length: 6 }, () => job('paused')));
      await fx.db.pool.query('NOTIFY helios_jobs');
      // Every run claimed ahead by the worker about to stop.
      await waitFor(
        'the runs claimed ahead',
        async () => {
          const { rows } = await fx.db.pool.query<{ n: number }>(
            `SELECT count(*)::int AS n FROM runs WHERE job_id = ANY($1::uuid[]) AND state = 'running'
               AND claimed_by = 'rev-stopping' AND started_at IS NULL`,
            [[...kept, ...paused]],
          );
          return rows[0]!.n === 12;
        },
        Math.max(500, at.getTime() - 1500 - Date.now()),
        20,
      );
      await sleep(Math.max(0, at.getTime() - 1500 - Date.now()));
      stopping.signal('SIGTERM');
      // Paused while the drain hands its runs back (before they are due).
      await Promise.all(paused.map((id) => pauseJob(fx.db.pool, { id }, commandOptions)));
      assert.ok(Date.now() < at.getTime(), 'paused before the runs were due');
      assert.equal((await stopping.exited).code, 0);

      const settled = async (jobId: string) => (await runsOf(fx.db.pool, jobId))[0]?.state === 'succeeded';
      await waitFor(
        "the kept jobs' runs to succeed",
        async () => (await Promise.all(kept.map(settled))).every(Boolean),
        30_000,
      );
      await sleep(Math.max(0, at.getTime() + 3000 - Date.now())); // past polling's reach too
      for (const jobId of paused) {
        assert.deepEqual(fx.target.forJob(jobId), [], 'no call of a job paused before its run was due');
        assert.deepEqual(await runsOf(fx.db.pool, jobId), [], 'its run withdrawn');
      }
      for (const jobId of kept) {
        const [run] = await runsOf(fx.db.pool, jobId);
        const attempts = await attemptsOf(fx.db.pool, run!.id);
        assert.deepEqual(
          attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
          [
            [1, 'rev-stopping', 'cancelled'],
            [2, 'rev-peer', 'succeeded'],
          ],
        );
        const { rows } = await fx.db.pool.query<{ finished: Date }>(
          `SELECT finished_at AS finished FROM run_attempts WHERE run_id = $1 AND attempt = 1`,
          [run!.id],
        );
        assert.ok(
          rows[0]!.finished.getTime() < at.getTime(),
          `handed back ${rows[0]!.finished.getTime() - at.getTime()} ms after due, not before`,
        );
        const calls = fx.target.forJob(jobId);
        assert.deepEqual(
          calls.map((c) => [c.attempt, c.aborted ?? false]),
          [[2, false]],
          'called once',
        );
        assert.ok(calls[0]!.arrivedAt >= at.getTime(), 'not called early');
        assert.ok(
          calls[0]!.arrivedAt - at.getTime() < 1000,
          `called ${calls[0]!.arrivedAt - at.getTime()} ms late`,
        );
      }
    } finally {
      await fx.teardown();
    }
  },
);
