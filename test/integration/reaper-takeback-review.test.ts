import assert from 'node:assert/strict';
import { after, afterEach, before, beforeEach, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import type { Leadership } from '../../src/coordination/election.js';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { createStartBatcher } from '../../src/execution/batching.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { FORGIVEN_EXPIRIES, Reaper } from '../../src/execution/reaper.js';
import { parseHandOff } from '../../src/execution/run-message.js';
import { deleteJob, pauseJob } from '../../src/jobs/commands.js';
import type { RunMessage } from '../../src/model.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { completeSucceeded, type AttemptReport } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { inFencedTransaction } from '../../src/store/fence.js';
import { HANDOFF_CHANNEL, handOffRuns, workersBut } from '../../src/store/handoff.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import { releaseClaims } from '../../src/store/releases.js';
import { claimRuns, startRuns, type ClaimedRun, type ClaimOptions } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { waitFor } from '../support/execution.js';
import { untilDbTime, within } from '../support/db-time.js';

// Review of the reaper's take-back (commits eabb33f, 5941416): never-started runs claimed ahead
// taken up to `unstartedBatchSize` (1000) a pass, in no order, beside at most `batchSize` (100) past
// their deadline, all forgiven in one statement (FORGIVE_MANY); the forgiven runs handed to the live
// workers other than their claimant after the pass commits. Each test forces one interleaving with
// transactions held open (or the reaper's own pass held between its SELECT and its FORGIVE_MANY), on
// the real PostgreSQL, and checks the contract: every occurrence runs, and runs once.

let db: TestDatabase;
let pool: pg.Pool;
const A = 'worker-a';
const B = 'worker-b';
const C = 'worker-c';
/** The reaper's line for runs claimed ahead and never started (the workers' claim grace). */
const UNSTARTED_MS = 300;
const topics = { runsTopic: 'takeback.runs', deadLetterTopic: 'takeback.dlq' };
const COMMANDS = { runsTopic: topics.runsTopic, misfireThresholdMs: 5000 };
const REGISTRY = [
  { id: 'api-only', roles: ['api', 'leader'] },
  ...[A, B, C].map((id) => ({ id, roles: ['api', 'leader', 'worker'] })),
];

before(async () => {
  db = await createTestDatabase();
  pool = new pg.Pool({ connectionString: db.url, max: 16, options: '-c TimeZone=UTC' });
  pool.on('error', () => undefined);
});
after(async () => {
  await pool.end();
  await db.drop();
});
beforeEach(() => pool.query('DELETE FROM jobs'));

/** Open transactions and loops still to end: a failed test must not leave its locks to the next. */
const cleanups = new Set<() => Promise<void>>();
afterEach(async () => {
  for (const end of cleanups) await end();
  cleanups.clear();
});

async function openTransaction() {
  const client = await pool.connect();
  await client.query('BEGIN');
  let open = true;
  const end = async (commit = false) => {
    if (!open) return;
    open = false;
    await client.query(commit ? 'COMMIT' : 'ROLLBACK').catch(() => undefined);
    client.release();
  };
  cleanups.add(() => end());
  return { client, commit: () => end(true), end };
}

const leadership = (signal = new AbortController().signal): Leadership => ({
  nodeId: 'leader',
  token: 1n,
  since: new Date(),
  signal,
  isValid: () => !signal.aborted,
});

function reaper(
  options: {
    pool?: pg.Pool;
    signal?: AbortSignal;
    batchSize?: number;
    unstartedBatchSize?: number;
    handOff?: (messages: RunMessage[], claimedBy: string | null) => void;
  } = {},
) {
  return new Reaper({
    pool: options.pool ?? pool,
    leadership: leadership(options.signal),
    topics,
    intervalMs: 1000,
    unstartedAfterMs: UNSTARTED_MS,
    batchSize: options.batchSize,
    unstartedBatchSize: options.unstartedBatchSize,
    logger: silentLogger,
    metrics: createMetrics('test'),
    onFenced: () => assert.fail('fenced'),
    handOff: options.handOff,
  });
}

/**
 * A pool whose connections stop the reaper's pass between its SELECT (the runs locked) and its
 * FORGIVE_MANY until `open()`: `held` resolves once the pass holds its runs.
 */
function gatedPool() {
  let reached!: () => void;
  const held = new Promise<void>((resolve) => (reached = resolve));
  let open!: () => void;
  const gate = new Promise<void>((resolve) => (open = resolve));
  const gated = new Proxy(pool, {
    get(target, prop, receiver) {
      if (prop !== 'connect') return Reflect.get(target, prop, receiver);
      return async () => {
        const client = await target.connect();
        const query = client.query.bind(client) as (...a: unknown[]) => unknown;
        return new Proxy(client, {
          get: (t, p) =>
            p === 'query'
              ? async (config: unknown, ...rest: unknown[]) => {
                  if ((config as { name?: string } | null)?.name === 'helios-forgive-many') {
                    reached();
                    await gate;
                  }
                  return query(config, ...rest);
                }
              : Reflect.get(t, p),
        });
      };
    },
  });
  cleanups.add(async () => open());
  return { pool: gated as pg.Pool, held, open };
}

/** `count` jobs (timeout 1 s, `maxAttempts`), their ids. */
async function makeJobs(count: number, maxAttempts = 1): Promise<string[]> {
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, next_run_at)
     SELECT 'takeback-' || g || '-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', 1000, $2,
            0, now() + interval '1 hour'
     FROM generate_series(1, $1) g RETURNING id`,
    [count, maxAttempts],
  );
  return rows.map((r) => r.id);
}

/**
 * Runs as a worker's claim ahead leaves them (CLAIM in store/runs.ts: attempt 1 and its record,
 * started_at NULL), one per job (`perJob` per job when one job is given), due `dueMs` from now
 * (negative: past), each `stepMs` later than the one before; claim deadline = due + timeout + 60 s
 * (a worker's claim grace far above the reaper's line, as a lagging or misconfigured worker's).
 * `past`: the claim's deadline is over instead, and the call began (started_at set).
 */
async function claimedAhead(
  jobIds: readonly string[],
  options: {
    nodeId: string;
    dueMs: number;
    perJob?: number;
    stepMs?: number;
    past?: boolean;
    expiries?: number;
    id?: string;
  },
): Promise<string[]> {
  const { rows } = await pool.query<{ id: string }>(
    `WITH made AS (
       INSERT INTO runs (id, job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                         backoff_multiplier, concurrency, not_before, claimed_by, claim_expires_at, started_at,
                         expiries)
       SELECT coalesce($8::uuid, gen_random_uuid()), j.id, t.due, 'running', 1, j.max_attempts, j.target,
              j.timeout_ms, 0, 1, 'allow', t.due, $2,
              CASE WHEN $6 THEN now() - interval '1 second' + n * interval '1 millisecond'
                   ELSE t.due + (j.timeout_ms + 60000) * interval '1 millisecond' END,
              CASE WHEN $6 THEN t.due END, $7
       FROM unnest($1::uuid[]) WITH ORDINALITY AS i (job, k)
       JOIN jobs j ON j.id = i.job
       CROSS JOIN generate_series(1, $5) AS g
       CROSS JOIN LATERAL (SELECT (i.k - 1) * $5 + g AS n) s
       CROSS JOIN LATERAL (SELECT clock_timestamp() + $3 * interval '1 millisecond'
                                  + s.n * $4 * interval '1 millisecond' AS due) t
       ORDER BY s.n
       RETURNING id, attempt, claimed_by, not_before
     ), recorded AS (
       INSERT INTO run_attempts (run_id, attempt, node_id, started_at)
       SELECT id, attempt, claimed_by, not_before FROM made
     )
     SELECT id FROM made`,
    [
      jobIds,
      options.nodeId,
      options.dueMs,
      options.stepMs ?? 0,
      options.perJob ?? 1,
      options.past ?? false,
      options.expiries ?? 0,
      options.id ?? null,
    ],
  );
  return rows.map((r) => r.id);
}

async function rowsOf(ids: readonly string[]) {
  const { rows } = await pool.query<{
    id: string;
    state: string;
    attempt: number;
    maxAttempts: number;
    claimedBy: string | null;
    started: boolean;
  }>(
    `SELECT r.id, r.state, r.attempt, r.max_attempts AS "maxAttempts", r.claimed_by AS "claimedBy",
            r.started_at IS NOT NULL AS started
     FROM unnest($1::uuid[]) WITH ORDINALITY AS i (id, n) JOIN runs r ON r.id = i.id ORDER BY i.n`,
    [ids],
  );
  return rows;
}

const countBy = (values: readonly string[]) => {
  const counts = new Map<string, number>();
  for (const v of values) counts.set(v, (counts.get(v) ?? 0) + 1);
  return counts;
};

/** The runs-topic announcements in the outbox, per run id: the attempts they announce. */
async function announcements(): Promise<Map<string, number[]>> {
  const { rows } = await pool.query<{ runId: string; attempt: number }>(
    `SELECT payload->>'runId' AS "runId", (payload->>'attempt')::int AS attempt FROM outbox WHERE topic = $1`,
    [topics.runsTopic],
  );
  const byRun = new Map<string, number[]>();
  for (const r of rows) byRun.set(r.runId, [...(byRun.get(r.runId) ?? []), r.attempt]);
  return byRun;
}

/** Whether a backend of this database waits for a lock while running a statement matching `like`. */
async function waitingOnLock(like: string): Promise<boolean> {
  const { rows } = await pool.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM pg_stat_activity
     WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1`,
    [like],
  );
  return rows[0]!.n > 0;
}
const START_TEXT = '%coalesce(r.started_at, statement_timestamp())%';

const claimOptions = (nodeId: string): ClaimOptions => ({
  nodeId,
  graceMs: 5000,
  skewToleranceMs: 10,
  leadMs: 600_000,
});

const success = (): AttemptReport => ({
  outcome: 'succeeded',
  statusCode: 200,
  durationMs: 1,
  error: null,
  responseExcerpt: null,
});

/** A worker's attempt context (real START batcher) whose executor records each call made. */
function context(nodeId: string, calls: string[]): AttemptContext {
  const starts = createStartBatcher(pool, nodeId, 10);
  const executor = {
    execute: async (run: ClaimedRun, cancel: AbortSignal): Promise<AttemptReport> => {
      if (cancel.aborted) return { ...success(), outcome: 'cancelled', statusCode: null };
      calls.push(`${nodeId}:${run.id}:${run.attempt}`);
      return success();
    },
  } as unknown as HttpExecutor;
  return {
    pool,
    nodeId,
    executor,
    topics,
    clock: new DbClock(),
    start: (run) => starts.add({ id: run.id, attempt: run.attempt }),
    complete: (run, report) => completeSucceeded(pool, run, nodeId, report),
    logger: silentLogger,
    metrics: createMetrics('test'),
  };
}

async function attempt(ctx: AttemptContext, run: ClaimedRun) {
  await ctx.clock.sync(pool);
  await runAttempt(ctx, run, new AbortController().signal);
}

// 1. START against a pass holding 1000 never-started runs, the pass first.

test('pass first: a START batch with 5 of the 1000 never-started runs a pass holds waits for it, starts only its 3 others; the 1000 are re-queued once, uncharged', async () => {
  const jobs = await makeJobs(1003);
  const past = await claimedAhead(jobs.slice(0, 1000), { nodeId: A, dueMs: -1000 });
  const later = await claimedAhead(jobs.slice(1000), { nodeId: A, dueMs: 60_000 });
  const gated = gatedPool();
  const pass = reaper({ pool: gated.pool }).reapBatch();
  await gated.held;

  const batch = [...past.slice(0, 5), ...later].map((id) => ({ id, attempt: 1 }));
  let startDone = false;
  const start = startRuns(pool, A, batch).finally(() => (startDone = true));
  await waitFor('START waiting for the rows the pass holds', () => waitingOnLock(START_TEXT), 3000, 10);
  assert.equal(startDone, false);
  gated.open();
  const { value: result } = await within(pass, 3000, 'the pass');
  assert.deepEqual(result, { reaped: 1000, full: true });
  assert.deepEqual(
    await within(start, 3000, 'START').then((s) => s.value),
    [false, false, false, false, false, true, true, true],
    'the runs taken back are not started (no call); the others are',
  );
  const rows = await rowsOf(past);
  assert.deepEqual(
    [...countBy(rows.map((r) => `${r.state}/${r.attempt}/${r.maxAttempts}/${r.started}/${r.claimedBy}`))],
    [['queued/1/2/false/null', 1000]],
  );
  const announced = await announcements();
  assert.deepEqual(
    [...countBy(past.map((id) => JSON.stringify(announced.get(id))))],
    [['[2]', 1000]],
    'one announcement of attempt 2 each',
  );
  assert.deepEqual(
    (await rowsOf(later)).map((r) => [r.state, r.started]),
    later.map(() => ['running', true]),
  );
});

// 2. START first, holding some never-started runs, then waiting for one the pass holds.

test('START first: a START transaction holding 5 never-started runs is skipped by the pass without waiting; its next statement waits for a run the pass holds and finds it gone; no deadlock', async () => {
  const jobs = await makeJobs(200);
  const past = await claimedAhead(jobs, { nodeId: A, dueMs: -1000 });
  const worker = await openTransaction();
  assert.deepEqual(
    await startRuns(
      worker.client,
      A,
      past.slice(0, 5).map((id) => ({ id, attempt: 1 })),
    ),
    [true, true, true, true, true],
  );
  const gated = gatedPool();
  const pass = reaper({ pool: gated.pool }).reapBatch();
  await within(gated.held, 2000, 'the pass skipping the rows START holds');
  // The worker's transaction, holding its 5 runs, now STARTs one the pass holds.
  const second = startRuns(worker.client, A, [{ id: past[10]!, attempt: 1 }]);
  await waitFor('START waiting for the pass', () => waitingOnLock(START_TEXT), 3000, 10);
  gated.open();
  assert.deepEqual((await within(pass, 3000, 'the pass')).value, { reaped: 195, full: true });
  assert.deepEqual(await second, [false], 'taken back by the pass: no call');
  await worker.commit();
  assert.deepEqual(
    await reaper().reapBatch(),
    { reaped: 0, full: false },
    'the started runs keep their claims',
  );
  const rows = await rowsOf(past);
  assert.deepEqual(
    rows.slice(0, 5).map((r) => [r.state, r.started]),
    past.slice(0, 5).map(() => ['running', true]),
  );
  assert.deepEqual([...countBy(rows.slice(5).map((r) => r.state))], [['queued', 195]]);
});

// 3. Something that waits on the pass with a lock held: pause -> START -> pass.

test('a pause waiting for a run a START batch holds while that batch waits for the pass: the chain ends with the pass; the started run is kept, the run taken back is not called', async () => {
  const [pausedJob] = await makeJobs(1);
  const jobs = await makeJobs(300);
  // The pause's run: claimed ahead, due in 3 s, the lowest id (START locks its runs in id order).
  const [soon] = await claimedAhead([pausedJob!], {
    nodeId: A,
    dueMs: 3000,
    id: '00000000-0000-4000-8000-000000000001',
  });
  const past = await claimedAhead(jobs, { nodeId: A, dueMs: -1000 });
  const gated = gatedPool();
  const pass = reaper({ pool: gated.pool }).reapBatch();
  await gated.held;
  const start = startRuns(pool, A, [
    { id: soon!, attempt: 1 },
    { id: past[0]!, attempt: 1 },
  ]);
  await waitFor('START waiting for the pass', () => waitingOnLock(START_TEXT), 3000, 10);
  const pause = pauseJob(pool, { id: pausedJob! }, COMMANDS);
  await waitFor(
    'the pause waiting for the run START holds',
    async () =>
      (
        await pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM pg_stat_activity
           WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%ORDER BY id%FOR UPDATE%'`,
        )
      ).rows[0]!.n > 0,
    3000,
    10,
  );
  gated.open();
  assert.deepEqual((await within(pass, 3000, 'the pass')).value, { reaped: 300, full: true });
  assert.deepEqual((await within(start, 3000, 'START')).value, [true, false]);
  assert.equal((await within(pause, 3000, 'the pause')).value?.enabled, false);
  assert.deepEqual(
    (await rowsOf([soon!, past[0]!])).map((r) => [r.state, r.started, r.claimedBy]),
    [
      ['running', true, A],
      ['queued', false, null],
    ],
    'START committed first: the pause keeps the started run; the run taken back is not started',
  );
});

// 4. A held job's never-started runs among the candidates: the job filter comes before the limit
// (it came after, and 1000 of them ahead in the scan kept every other run from being taken).

/** 1000 never-started runs of one job a command holds, due first; one free run due after them. */
async function heldAheadOfFree() {
  const [heldJob, freeJob] = await makeJobs(2);
  const held = await claimedAhead([heldJob!], { nodeId: A, dueMs: -20_000, perJob: 1000, stepMs: 1 });
  const [free] = await claimedAhead([freeJob!], { nodeId: A, dueMs: -1000 });
  const command = await openTransaction();
  await command.client.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [heldJob]);
  return { held, free: free!, command };
}

/** Reaper.run on a pool of its own; `acquired()` counts its connections (two per idle loop). */
function startLoop() {
  const own = new pg.Pool({ connectionString: db.url, max: 2, options: '-c TimeZone=UTC' });
  own.on('error', () => undefined);
  let acquired = 0;
  own.on('acquire', () => void (acquired += 1));
  const controller = new AbortController();
  const done = reaper({ pool: own, signal: controller.signal }).run();
  let stopped: Promise<void> | undefined;
  const stop = () =>
    (stopped ??= (async () => {
      controller.abort();
      await done;
      await own.end();
    })());
  cleanups.add(stop);
  return { acquired: () => acquired, stop };
}

test('1000 never-started runs of a job a command holds: the reaper loop does not spin (full is false when nothing was taken)', async () => {
  const { held } = await heldAheadOfFree();
  const loop = startLoop();
  await sleep(300);
  const before = loop.acquired();
  await sleep(1000);
  const perSecond = loop.acquired() - before;
  await loop.stop();
  assert.ok(perSecond <= 25, `${perSecond} connections a second (two per loop)`);
  assert.deepEqual([...countBy((await rowsOf(held)).map((r) => r.state))], [['running', 1000]]);
});

test('1000 never-started runs of a job a command holds, due first: a free run past the line behind them is still taken back', async () => {
  const { held, free, command } = await heldAheadOfFree();
  const r = reaper();
  const first = await r.reapBatch();
  const second = await r.reapBatch();
  const freeNow = (await rowsOf([free]))[0]!;
  assert.deepEqual(
    { first, second, free: freeNow.state },
    { first: { reaped: 1, full: false }, second: { reaped: 0, full: false }, free: 'queued' },
    'the free run is taken while the held job waits',
  );
  await command.end();
  assert.deepEqual(await r.reapBatch(), { reaped: 1000, full: true });
  assert.deepEqual([...countBy((await rowsOf(held)).map((r) => r.state))], [['queued', 1000]]);
});

// 5. The hand-off reaching another worker while the old claimant wakes up.

/** A LISTEN connection on the hand-off channel; `readBy(worker)` parses what is addressed to it. */
async function listen() {
  const listener = new pg.Client({ connectionString: db.url });
  await listener.connect();
  const payloads: string[] = [];
  listener.on('notification', (n) => payloads.push(n.payload ?? ''));
  await listener.query(`LISTEN ${HANDOFF_CHANNEL}`);
  cleanups.add(() => listener.end().catch(() => undefined));
  return {
    payloads,
    readBy: (worker: string) => payloads.flatMap((p) => parseHandOff(p, worker)),
  };
}

/** A reaper whose hand-off goes out as the node sends it (handOffRuns to workersBut the claimant). */
function handingReaper(
  handed: { claimedBy: string | null; messages: RunMessage[] }[],
  sent: Promise<number>[],
) {
  return reaper({
    handOff: (messages, claimedBy) => {
      handed.push({ claimedBy, messages });
      sent.push(handOffRuns(pool, messages, workersBut(REGISTRY, claimedBy)));
    },
  });
}

test('the hand-off reaches another worker, which claims and calls attempt 2; the old claimant wakes: its START, its claim of the Kafka copy and its completion all miss; one call', async () => {
  const [jobId] = await makeJobs(1);
  const { rows } = await pool.query<{ id: string; due: Date }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, t, 'queued', 1, target, timeout_ms, 0, 1, 'allow', t
     FROM jobs, (SELECT clock_timestamp() + interval '150 milliseconds' AS t) s WHERE id = $1
     RETURNING id, scheduled_for AS due`,
    [jobId],
  );
  const run = rows[0]!;
  const [claimedA] = await claimRuns(pool, [{ runId: run.id, expectedAttempt: 1 }], claimOptions(A));
  assert.equal(claimedA?.startPending, true);
  await untilDbTime(pool, run.due.getTime() + UNSTARTED_MS + 50);

  const { readBy } = await listen();
  const handed: { claimedBy: string | null; messages: RunMessage[] }[] = [];
  const sent: Promise<number>[] = [];
  assert.deepEqual(await handingReaper(handed, sent).reapBatch(), { reaped: 1, full: false });
  await Promise.all(sent);
  await waitFor('the hand-off', () => readBy(B).length + readBy(C).length > 0, 2000, 10);
  assert.deepEqual(readBy(A), [], 'not handed to its claimant');
  const receiver = readBy(B).length > 0 ? B : C;
  const [message] = readBy(receiver);
  assert.deepEqual([message?.runId, message?.attempt], [run.id, 2]);

  const calls: string[] = [];
  const [claimedByReceiver] = await claimRuns(
    pool,
    [{ runId: run.id, expectedAttempt: message!.attempt }],
    claimOptions(receiver),
  );
  assert.ok(claimedByReceiver, 'the receiver claims attempt 2');
  // The old claimant wakes up: its attempt 1 (START first), then the Kafka copy of attempt 2.
  await attempt(context(A, calls), claimedA!);
  const kafka = (await announcements()).get(run.id);
  assert.deepEqual(kafka, [2]);
  assert.deepEqual(await claimRuns(pool, [{ runId: run.id, expectedAttempt: 2 }], claimOptions(A)), [null]);
  assert.equal(await completeSucceeded(pool, claimedA!, A, success()), false);
  await attempt(context(receiver, calls), claimedByReceiver);
  assert.deepEqual(calls, [`${receiver}:${run.id}:2`], 'one call, by the receiver');
  const { rows: attempts } = await pool.query<{ attempt: number; node: string; outcome: string }>(
    `SELECT attempt, node_id AS node, outcome FROM run_attempts WHERE run_id = $1 ORDER BY attempt`,
    [run.id],
  );
  assert.deepEqual(
    attempts.map((a) => [a.attempt, a.node, a.outcome]),
    [
      [1, A, 'expired'],
      [2, receiver, 'succeeded'],
    ],
  );
});

// 6. A forgiven run announced twice (Kafka and the hand-off), and the polling fallback.

test('a forgiven run announced on Kafka and handed off: the claim from each copy and the polling fallback race; one claim of attempt 2', async () => {
  const jobs = await makeJobs(1);
  const [id] = await claimedAhead(jobs, { nodeId: A, dueMs: -1000 });
  assert.deepEqual(await reaper().reapBatch(), { reaped: 1, full: false });
  const handOffClaim = await openTransaction();
  const [b] = await claimRuns(handOffClaim.client, [{ runId: id!, expectedAttempt: 2 }], claimOptions(B));
  assert.equal(b?.attempt, 2);
  let kafkaDone = false;
  const kafkaClaim = claimRuns(pool, [{ runId: id!, expectedAttempt: 2 }], claimOptions(A)).finally(
    () => (kafkaDone = true),
  );
  const polled = await inTransaction(pool, (c) => claimOverdueRuns(c, 0, 100, claimOptions(C)));
  assert.deepEqual(polled.claimed, [], 'the polling fallback skips the row the claim holds');
  await sleep(100);
  assert.equal(kafkaDone, false, 'the Kafka copy’s claim waits for the row');
  await handOffClaim.commit();
  assert.deepEqual(await kafkaClaim, [null]);
  const [now] = await rowsOf([id!]);
  assert.deepEqual([now?.state, now?.attempt, now?.claimedBy], ['running', 2, B]);
  const { rows } = await pool.query<{ n: number }>(
    'SELECT count(*)::int AS n FROM run_attempts WHERE run_id = $1',
    [id],
  );
  assert.equal(rows[0]!.n, 2);
});

// 7. More than a pass of never-started runs, and runs past their deadline.

test('2,300 never-started runs of two claimants and 150 past their deadline (30 to bury): each taken back once, in 5 passes, each forgiven one handed once to a worker other than its claimant', async (t) => {
  const herd = await makeJobs(2300);
  const fromA = await claimedAhead(herd.slice(0, 1500), { nodeId: A, dueMs: -1000 });
  const fromB = await claimedAhead(herd.slice(1500), { nodeId: B, dueMs: -1000 });
  const late = await claimedAhead(await makeJobs(120, 3), { nodeId: C, dueMs: -10_000, past: true });
  const buried = await claimedAhead(await makeJobs(30, 1), {
    nodeId: C,
    dueMs: -10_000,
    past: true,
    expiries: FORGIVEN_EXPIRIES,
  });
  const { readBy } = await listen();
  const handed: { claimedBy: string | null; messages: RunMessage[] }[] = [];
  const sent: Promise<number>[] = [];
  const r = handingReaper(handed, sent);
  const passes: { reaped: number; full: boolean }[] = [];
  const t0 = performance.now();
  for (let pass = r.reapBatch(); ; pass = r.reapBatch()) {
    const result = await pass;
    passes.push(result);
    if (!result.full || passes.length > 10) break;
  }
  t.diagnostic(`${Math.round(performance.now() - t0)} ms for the passes`);
  assert.deepEqual(
    passes.map((p) => p.reaped),
    [100, 1050, 1000, 300, 0],
  );
  await Promise.all(sent);

  const forgiven = [...fromA, ...fromB, ...late];
  const rows = await rowsOf([...forgiven, ...buried]);
  assert.deepEqual([...countBy(rows.map((x) => `${x.state}/${x.attempt}`))].sort(), [
    ['dead/1', 30],
    ['queued/1', 2420],
  ]);
  const announced = await announcements();
  assert.deepEqual(
    [...countBy(forgiven.map((id) => JSON.stringify(announced.get(id) ?? [])))],
    [['[2]', 2420]],
  );
  assert.deepEqual(
    buried.filter((id) => announced.has(id)),
    [],
  );
  const { rows: letters } = await pool.query<{ n: number }>(
    'SELECT count(*)::int AS n FROM dead_letters WHERE run_id = ANY($1::uuid[])',
    [buried],
  );
  assert.equal(letters[0]!.n, 30);
  // Handed once each, grouped by claimant, never to it.
  const byClaimant = new Map<string, string[]>();
  for (const h of handed) {
    byClaimant.set(String(h.claimedBy), [
      ...(byClaimant.get(String(h.claimedBy)) ?? []),
      ...h.messages.map((m) => m.runId),
    ]);
  }
  assert.deepEqual(new Set(byClaimant.get(A)), new Set(fromA));
  assert.equal(byClaimant.get(A)!.length, fromA.length);
  assert.deepEqual(new Set(byClaimant.get(B)), new Set(fromB));
  assert.equal(byClaimant.get(B)!.length, fromB.length);
  assert.deepEqual(new Set(byClaimant.get(C)), new Set(late));
  assert.equal(byClaimant.get(C)!.length, late.length);
  await waitFor(
    'every hand-off received',
    () => readBy(A).length + readBy(B).length + readBy(C).length === forgiven.length,
    3000,
    20,
  );
  const claimant = new Map([
    ...fromA.map((id) => [id, A] as const),
    ...fromB.map((id) => [id, B] as const),
    ...late.map((id) => [id, C] as const),
  ]);
  const receivers = new Map<string, string[]>();
  for (const worker of [A, B, C]) {
    for (const m of readBy(worker)) receivers.set(m.runId, [...(receivers.get(m.runId) ?? []), worker]);
  }
  const wrong = forgiven.filter((id) => {
    const to = receivers.get(id) ?? [];
    return to.length !== 1 || to[0] === claimant.get(id);
  });
  assert.deepEqual(wrong, [], 'each forgiven run handed to exactly one worker, not its claimant');
});

// 8. The fenced transaction, now longer: the dispatcher's fenced transaction waits for it.

test('a pass of 99 charged runs and 1000 never-started ones holds the fence: how long a dispatcher-like fenced transaction waits', async (t) => {
  await claimedAhead(await makeJobs(1000), { nodeId: A, dueMs: -1000 });
  await claimedAhead(await makeJobs(99, 3), {
    nodeId: C,
    dueMs: -10_000,
    past: true,
    expiries: FORGIVEN_EXPIRIES,
  });
  const r = reaper();
  const t0 = performance.now();
  const pass = r.reapBatch().then((value) => ({ value, ms: performance.now() - t0 }));
  // The dispatcher's transaction raises the fence first, as every leader write does.
  await sleep(20);
  const t1 = performance.now();
  const dispatch = inFencedTransaction(pool, leadership(), async (client) => {
    await client.query('SELECT 1');
    return performance.now() - t1;
  });
  const [{ value, ms }, waited] = await Promise.all([pass, dispatch]);
  assert.deepEqual(value, { reaped: 1099, full: true });
  t.diagnostic(`pass ${Math.round(ms)} ms; the fenced transaction behind it waited ${Math.round(waited)} ms`);
});

// 9. The old claimant, stopping, hands back claims the pass holds (RELEASE_MANY against FORGIVE_MANY).

test('a stopping claimant hands back 10 never-started runs the pass holds: its release waits, finds them gone; each run is re-queued and announced once, max_attempts grown once', async () => {
  const past = await claimedAhead(await makeJobs(150), { nodeId: A, dueMs: -1000 });
  const gated = gatedPool();
  const pass = reaper({ pool: gated.pool }).reapBatch();
  await gated.held;
  const cancelled: AttemptReport = { ...success(), outcome: 'cancelled', statusCode: null, durationMs: null };
  const release = releaseClaims(
    pool,
    A,
    past.slice(0, 10).map((id) => ({ run: { id, attempt: 1 }, report: cancelled })),
    topics.runsTopic,
  );
  await waitFor(
    'the release waiting for the pass',
    () => waitingOnLock('%max_attempts = r.max_attempts + 1%'),
    3000,
    10,
  );
  gated.open();
  assert.deepEqual((await within(pass, 3000, 'the pass')).value, { reaped: 150, full: true });
  assert.deepEqual(
    (await within(release, 3000, 'the release')).value,
    past.slice(0, 10).map(() => null),
    'nothing handed back twice (no hand-off of the stopping worker either)',
  );
  assert.deepEqual(
    [...countBy((await rowsOf(past)).map((r) => `${r.state}/${r.attempt}/${r.maxAttempts}`))],
    [['queued/1/2', 150]],
  );
  const announced = await announcements();
  assert.deepEqual([...countBy(past.map((id) => JSON.stringify(announced.get(id))))], [['[2]', 150]]);
});

// 10. A delete of the job racing the pass, and the hand-off of its run.

test('a job deleted while the pass holds its never-started run: the delete waits for the pass, then removes the run; the hand-off’s claim finds nothing', async () => {
  const [jobId] = await makeJobs(1);
  const [id] = await claimedAhead([jobId!], { nodeId: A, dueMs: -1000 });
  const gated = gatedPool();
  const handed: RunMessage[] = [];
  const pass = reaper({ pool: gated.pool, handOff: (messages) => handed.push(...messages) }).reapBatch();
  await gated.held;
  let deleted = false;
  const removal = deleteJob(pool, { id: jobId! }).finally(() => (deleted = true));
  await sleep(150);
  assert.equal(deleted, false, "the delete waits for the pass's key-share lock on the job");
  gated.open();
  assert.deepEqual((await within(pass, 3000, 'the pass')).value, { reaped: 1, full: false });
  assert.equal((await within(removal, 3000, 'the delete')).value, true);
  assert.deepEqual(
    handed.map((m) => [m.runId, m.attempt]),
    [[id, 2]],
  );
  assert.deepEqual(
    await claimRuns(pool, [{ runId: id!, expectedAttempt: handed[0]!.attempt }], claimOptions(B)),
    [null],
  );
  assert.deepEqual(await rowsOf([id!]), []);
});
