import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, afterEach, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import { pino } from 'pino';
import type { Leadership } from '../../src/coordination/election.js';
import { FORGIVEN_EXPIRIES, Reaper, UnstartedClaimsHold } from '../../src/execution/reaper.js';
import { pauseJob } from '../../src/jobs/commands.js';
import type { Logger } from '../../src/observability/logger.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics, type Metrics } from '../../src/observability/metrics.js';
import { selectExpiredRuns } from '../../src/store/attempts.js';
import { inFencedTransaction } from '../../src/store/fence.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { waitFor } from '../support/execution.js';
import { within } from '../support/db-time.js';

// The reaper's SELECT_EXPIRED takes a key-share lock on each expired run's job, SKIP LOCKED, so a
// run whose job a pause, an edit or a delete holds (FOR UPDATE, up to its 30 s lock patience) is left
// to a later pass instead of stalling the pass (and, through the fence row, the dispatcher). These
// tests put that statement against the real writers of the rows it locks, on the real PostgreSQL.

let db: TestDatabase;
let pool: pg.Pool;
const topics = { runsTopic: 'reaper-review.runs', deadLetterTopic: 'reaper-review.dlq' };

before(async () => {
  db = await createTestDatabase();
  pool = new pg.Pool({ connectionString: db.url, max: 12, options: '-c TimeZone=UTC' });
  pool.on('error', () => undefined);
});
after(async () => {
  await pool.end();
  await db.drop();
});

/** Open transactions still to end (a failed test must not leave its locks to the next). */
const holders = new Set<() => Promise<void>>();
/** Reaper loops still running (a failed test must not leave one to the next). */
const loops = new Set<() => Promise<void>>();
afterEach(async () => {
  // Locks first: a loop whose pass waits for one of them stops only once it is let go.
  for (const end of holders) await end();
  holders.clear();
  for (const stop of loops) await stop();
  loops.clear();
  // Each test starts with no expired claim left by an earlier one.
  await pool.query('DELETE FROM jobs');
});

async function openTransaction() {
  const client = await pool.connect();
  await client.query('BEGIN');
  let open = true;
  const end = async () => {
    if (!open) return;
    open = false;
    await client.query('ROLLBACK').catch(() => undefined);
    client.release();
  };
  holders.add(end);
  return { client, end };
}

async function makeJob(maxAttempts: number): Promise<string> {
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, next_run_at)
     VALUES ('reaper-review-' || gen_random_uuid(), '* * * * *', '{"url":"http://127.0.0.1:9/"}', 5000, $1, 0, NULL)
     RETURNING id`,
    [maxAttempts],
  );
  return rows[0]!.id;
}

/**
 * `count` runs of `jobId` claimed by a worker whose claim expired `agoMs` ago (each 1 ms apart,
 * oldest first), called (started_at set), attempt 1. `burial`: the run used up its forgiven expiries
 * and its attempts, so the reaper buries it (a dead letter, whose foreign key needs the job's row).
 */
async function expiredRuns(jobId: string, count: number, options: { agoMs: number; burial: boolean }) {
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before, claimed_by, claim_expires_at, started_at,
                       expiries)
     SELECT j.id, clock_timestamp() - interval '1 day' + g * interval '1 millisecond', 'running', 1,
            CASE WHEN $4 THEN 1 ELSE 3 END, j.target, j.timeout_ms, 0, 1, 'allow', now() - interval '1 minute',
            'dead-worker', now() - $3 * interval '1 millisecond' + g * interval '1 millisecond',
            now() - interval '1 minute', CASE WHEN $4 THEN $5::int ELSE 0 END
     FROM jobs j, generate_series(1, $2) AS g WHERE j.id = $1
     ORDER BY g
     RETURNING id`,
    [jobId, count, options.agoMs, options.burial, FORGIVEN_EXPIRIES],
  );
  return rows.map((r) => r.id);
}

async function states(ids: readonly string[]): Promise<string[]> {
  const { rows } = await pool.query<{ state: string }>(
    `SELECT r.state FROM unnest($1::uuid[]) WITH ORDINALITY AS i (id, n) LEFT JOIN runs r ON r.id = i.id ORDER BY i.n`,
    [ids],
  );
  return rows.map((r) => r.state ?? 'gone');
}

async function lettersOf(ids: readonly string[]): Promise<Map<string, number>> {
  const { rows } = await pool.query<{ runId: string; n: number }>(
    `SELECT run_id AS "runId", count(*)::int AS n FROM dead_letters WHERE run_id = ANY($1::uuid[]) GROUP BY run_id`,
    [ids],
  );
  return new Map(rows.map((r) => [r.runId, r.n]));
}

/** Every run of `ids` dead, with one dead letter each. */
async function assertBuriedOnce(ids: readonly string[]): Promise<void> {
  assert.deepEqual(new Set(await states(ids)), new Set(['dead']));
  const letters = await lettersOf(ids);
  assert.deepEqual(
    ids.map((id) => letters.get(id)),
    ids.map(() => 1),
    'one dead letter per run',
  );
}

function fakeLeadership(signal = new AbortController().signal): Leadership {
  return { nodeId: 'leader', token: 1n, since: new Date(), signal, isValid: () => !signal.aborted };
}

/** A logger that keeps the messages of its warn lines (runLeaderLoop's `reaper pass failed`). */
function warnings(): { logger: Logger; messages: string[] } {
  const messages: string[] = [];
  const logger = pino(
    { level: 'warn' },
    { write: (line: string) => void messages.push(JSON.parse(line).msg) },
  );
  return { logger: logger as unknown as Logger, messages };
}

/** helios_reaper_passes_cut_total by reason. */
async function passesCut(metrics: Metrics): Promise<Record<string, number>> {
  const { values } = await metrics.reaperPassesCut.get();
  return Object.fromEntries(values.map((v) => [String(v.labels.reason), v.value]));
}

function reaper(
  options: {
    batchSize?: number;
    pool?: pg.Pool;
    signal?: AbortSignal;
    logger?: Logger;
    statementTimeoutMs?: number;
    unstartedAfterMs?: number;
    unstartedHold?: UnstartedClaimsHold;
    metrics?: Metrics;
  } = {},
) {
  return new Reaper({
    pool: options.pool ?? pool,
    leadership: fakeLeadership(options.signal),
    topics,
    intervalMs: 1000,
    batchSize: options.batchSize,
    statementTimeoutMs: options.statementTimeoutMs,
    unstartedAfterMs: options.unstartedAfterMs,
    unstartedHold: options.unstartedHold,
    logger: options.logger ?? silentLogger,
    metrics: options.metrics ?? createMetrics('test'),
    onFenced: () => assert.fail('fenced'),
  });
}

/**
 * Starts Reaper.run (the leader's loop) on a pool of its own; `passes()` counts the connections it
 * took (two per loop when nothing is reaped: the fenced pass and msUntilNextExpiry).
 */
function startLoop() {
  const own = new pg.Pool({ connectionString: db.url, max: 2, options: '-c TimeZone=UTC' });
  own.on('error', () => undefined);
  let acquired = 0;
  own.on('acquire', () => void (acquired += 1));
  const controller = new AbortController();
  const { logger, messages } = warnings();
  const done = reaper({ pool: own, signal: controller.signal, logger }).run();
  let stopped: Promise<void> | undefined;
  const stop = () =>
    (stopped ??= (async () => {
      controller.abort();
      await done;
      await own.end();
    })());
  loops.add(stop);
  return { acquired: () => acquired, failures: () => messages.filter((m) => /failed/.test(m)), stop };
}

test("a held job's expired runs, more than a batch and older than the rest, neither stall a pass nor take its places", async () => {
  const held = await makeJob(1);
  const free = await makeJob(3);
  // Eight burial-bound runs of the held job expired first; the free job's three retries after them.
  const heldRuns = await expiredRuns(held, 8, { agoMs: 60_000, burial: true });
  const freeRuns = await expiredRuns(free, 3, { agoMs: 30_000, burial: false });
  const command = await openTransaction();
  await command.client.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [held]);

  const r = reaper({ batchSize: 5 });
  const first = await within(r.reapBatch(), 3000, 'the pass (it waited for the job the command holds)');
  assert.deepEqual(first.value, { reaped: 3, full: false }, "the free job's runs fill the batch's places");
  assert.deepEqual(await states(freeRuns), ['queued', 'queued', 'queued']);
  assert.deepEqual(new Set(await states(heldRuns)), new Set(['running']), "the held job's runs wait");

  await command.end();
  // Once the command ended, its runs are buried, each once, over two passes of five.
  assert.deepEqual(await r.reapBatch(), { reaped: 5, full: true });
  assert.deepEqual(await r.reapBatch(), { reaped: 3, full: false });
  assert.deepEqual(await r.reapBatch(), { reaped: 0, full: false });
  await assertBuriedOnce(heldRuns);
});

test('a pause holding its job for seconds (yielding to a worker) while the reaper loops: other jobs are recovered meanwhile, the held run is buried once after it', async (t) => {
  const paused = await makeJob(1);
  const [dying] = await expiredRuns(paused, 1, { agoMs: 5000, burial: true });
  // A run of the paused job created ahead of its time, not begun, which a worker's batch holds: the
  // pause's withdrawal waits for it, yielding every 50 ms and keeping the job row all along.
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before)
     SELECT id, now() + interval '1 hour', 'queued', 1, target, timeout_ms, 0, 1, now() + interval '1 hour'
     FROM jobs WHERE id = $1 RETURNING id`,
    [paused],
  );
  const ahead = rows[0]!.id;
  const worker = await openTransaction();
  await worker.client.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE', [ahead]);

  const loop = startLoop();
  const t0 = performance.now();
  const pause = pauseJob(pool, { id: paused }, { runsTopic: topics.runsTopic, misfireThresholdMs: 5000 });
  await waitFor(
    'the pause waiting for the held run',
    async () =>
      (
        await pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM pg_stat_activity
           WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%started_at IS NULL%'`,
        )
      ).rows[0]!.n > 0,
    10_000,
    10,
  );
  // While the pause holds its job: a run of another job expires, and the loop recovers it.
  const other = await makeJob(3);
  const [stranded] = await expiredRuns(other, 1, { agoMs: 1, burial: false });
  await waitFor(
    'the other job recovered while the pause holds its job',
    async () => (await states([stranded!]))[0] === 'queued',
    3000,
    20,
  );
  const before = loop.acquired();
  await sleep(1000);
  const perSecond = loop.acquired() - before;
  assert.equal((await states([dying!]))[0], 'running', "the held job's run waits for the pause");

  await worker.end();
  const paused_ = await within(pause, 5000, 'the pause');
  assert.equal(paused_.value?.enabled, false);
  await waitFor('the held run buried', async () => (await states([dying!]))[0] === 'dead', 3000, 20);
  await sleep(200);
  await loop.stop();
  assert.deepEqual(loop.failures(), [], 'reaper passes failed');
  assert.deepEqual(await states([ahead, dying!, stranded!]), ['gone', 'dead', 'queued']);
  assert.equal((await lettersOf([dying!])).get(dying!), 1, 'one dead letter');
  const { rows: announced } = await pool.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM outbox WHERE topic = $1 AND payload->>'runId' = $2`,
    [topics.deadLetterTopic, dying],
  );
  assert.equal(announced[0]!.n, 1, 'one dead-letter announcement');
  t.diagnostic(
    `held for ${Math.round(performance.now() - t0)} ms; reaper loop: ${perSecond} connections a second while its job was held`,
  );
});

test("a replay, a worker's burial or a trigger key-sharing a job does not make the reaper skip its runs, nor wait for it", async () => {
  const job = await makeJob(1);
  const [first, second] = await expiredRuns(job, 2, { agoMs: 5000, burial: true });
  // Something takes the key-share lock a replay (LOCK_JOB_OF_LETTER), a worker's burial
  // (lockFreeJobs) or a run's foreign key takes: the reaper's key-share lock does not conflict.
  const sharer = await openTransaction();
  await sharer.client.query('SELECT 1 FROM jobs WHERE id = $1 FOR KEY SHARE', [job]);
  const pass = await within(reaper().reapBatch(), 3000, 'the pass (it waited for a key-share lock)');
  assert.deepEqual(pass.value, { reaped: 2, full: false });
  await sharer.end();
  assert.deepEqual(await states([first!, second!]), ['dead', 'dead']);

  // The other way round: the reaper's statement holds the job's key-share lock (its transaction
  // open) while a dead letter of the same job is replayed.
  const [third] = await expiredRuns(job, 1, { agoMs: 4000, burial: true });
  const pass2 = await openTransaction();
  const selected = await selectExpiredRuns(pass2.client, 100);
  assert.deepEqual(
    selected.map((r) => r.id),
    [third],
  );
  const { rows } = await pool.query<{ id: string }>('SELECT id FROM dead_letters WHERE run_id = $1', [first]);
  const replay = await within(
    replayDeadLetter(pool, rows[0]!.id, topics),
    3000,
    'the replay (it waited for the reaper)',
  );
  assert.equal(replay.value?.runId, first);
  await pass2.end();
});

/** True when another transaction holds `runId`'s row (a NOWAIT lock attempt fails). */
async function lockedByOther(runId: string): Promise<boolean> {
  const probe = await openTransaction();
  try {
    await probe.client.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE NOWAIT', [runId]);
    return false;
  } catch (err) {
    if ((err as { code?: string }).code === '55P03') return true;
    throw err;
  } finally {
    await probe.end();
  }
}

test("a pass leaves the held job's runs unlocked (it does not lock, and write, every one of them each pass)", async () => {
  const held = await makeJob(1);
  const heldRuns = await expiredRuns(held, 50, { agoMs: 60_000, burial: true });
  const free = await makeJob(3);
  await expiredRuns(free, 1, { agoMs: 1000, burial: false });
  const command = await openTransaction();
  await command.client.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [held]);
  const pass = await openTransaction();
  const selected = await selectExpiredRuns(pass.client, 100);
  assert.equal(selected.length, 1);
  const locked: string[] = [];
  for (const id of heldRuns) if (await lockedByOther(id)) locked.push(id);
  assert.deepEqual(
    locked,
    [],
    `${locked.length} of the held job's ${heldRuns.length} runs locked by the pass`,
  );
});

test('the reaper loop polls a held job at most a few times a second, not every 10 ms', async () => {
  const held = await makeJob(1);
  await expiredRuns(held, 1, { agoMs: 1000, burial: true });
  const command = await openTransaction();
  await command.client.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [held]);
  const loop = startLoop();
  await sleep(300);
  const before = loop.acquired();
  await sleep(2000);
  const perSecond = (loop.acquired() - before) / 2;
  await loop.stop();
  assert.ok(perSecond <= 25, `${perSecond} connections a second (two per loop)`);
});

// The statement's plan, as the reaper's selectExpiredRuns sends it (the text captured, then prepared).
async function expiredPlan(c: pg.PoolClient, analyze: boolean): Promise<Record<string, unknown>> {
  let text = '';
  await selectExpiredRuns(
    {
      query: async (sql: string) => {
        text = sql;
        return { rows: [] };
      },
    } as never,
    100,
    { unstartedAfterMs: 5000 },
  );
  const name = `expired_${randomUUID().slice(0, 8)}`;
  await c.query(`PREPARE ${name} (int, int, int) AS ${text}`);
  try {
    await c.query('BEGIN');
    const { rows } = await c.query<{ 'QUERY PLAN': { Plan: Record<string, unknown> }[] }>(
      `EXPLAIN (FORMAT JSON${analyze ? ', ANALYZE' : ''}) EXECUTE ${name} (100, 5000, 1000)`,
    );
    await c.query('ROLLBACK');
    return rows[0]!['QUERY PLAN'][0]!.Plan;
  } finally {
    await c.query(`DEALLOCATE ${name}`);
  }
}

function nodes(plan: Record<string, unknown>): Record<string, unknown>[] {
  const children = (plan.Plans as Record<string, unknown>[] | undefined) ?? [];
  return [plan, ...children.flatMap(nodes)];
}

const describeNode = (n: Record<string, unknown>) =>
  `${String(n['Node Type'])}${n['Index Name'] ? ` ${String(n['Index Name'])}` : n['Relation Name'] ? ` ${String(n['Relation Name'])}` : ''}`;

/** `jobs` jobs; `perJob` runs of each; of them `running` running, `expired` of those past their claim. */
async function herd(
  c: pg.PoolClient,
  options: { jobs: number; perJob: number; running: number; expired: number; staleStats: boolean },
) {
  await c.query(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, next_run_at)
     SELECT 'plan-' || g, '* * * * *', '{"url":"http://127.0.0.1:9/"}', 5000, 3, 0, NULL FROM generate_series(1, $1) g`,
    [options.jobs],
  );
  await c.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before, finished_at)
     SELECT j.id, now() - g * interval '1 second', 'succeeded', 1, 3, j.target, 5000, 0, 1, now(), now()
     FROM jobs j, generate_series(1, $1) g`,
    [options.perJob],
  );
  // The runs that will be running: queued while the statistics are taken (as autovacuum analyses a
  // herd seconds after its dispatch), or already running.
  const pick = `id IN (SELECT id FROM runs ORDER BY scheduled_for DESC, id LIMIT ${options.running})`;
  if (options.staleStats) {
    await c.query(`UPDATE runs SET state = 'queued', finished_at = NULL WHERE ${pick}`);
    await c.query('VACUUM ANALYZE runs');
    await c.query('VACUUM ANALYZE jobs');
  }
  await c.query(
    `UPDATE runs SET state = 'running', finished_at = NULL, claimed_by = 'w', started_at = now(),
                     claim_expires_at = now() + interval '1 hour'
     WHERE ${pick}`,
  );
  await c.query(
    `UPDATE runs SET claim_expires_at = now() - random() * interval '100 seconds'
     WHERE id IN (SELECT id FROM runs WHERE state = 'running' ORDER BY random() LIMIT ${options.expired})`,
  );
  if (!options.staleStats) {
    await c.query('VACUUM ANALYZE runs');
    await c.query('VACUUM ANALYZE jobs');
  }
}

const PLAN_CASES = [
  {
    name: 'fresh statistics, 2,000 jobs, 20,000 runs, 5,000 running, 500 expired',
    herd: { jobs: 2000, perJob: 10, running: 5000, expired: 500, staleStats: false },
  },
  {
    name: 'statistics taken before the herd was claimed, 200 jobs, 20,000 runs all expired',
    herd: { jobs: 200, perJob: 100, running: 20_000, expired: 20_000, staleStats: true },
  },
];

/** The statement's plan, analysed, on a database of its own filled as `herd` says. */
async function planOf(options: Parameters<typeof herd>[1]) {
  const other = await createTestDatabase();
  const c = await other.pool.connect();
  try {
    await herd(c, options);
    return nodes(await expiredPlan(c, true));
  } finally {
    c.release();
    await other.drop();
  }
}

test('the statement reads runs only through runs_running_idx, in order, whatever the statistics say', async () => {
  for (const { name, herd: options } of PLAN_CASES) {
    const all = await planOf(options);
    const shown = all.map(describeNode).join(' > ');
    // A run's failed calls since its last replay (its back-off: failuresBefore in runs.ts) are
    // looked up in run_attempts and dead_letters by their keys; only the scans of runs count here.
    const onRuns = all.filter(
      (n) =>
        n['Relation Name'] === 'runs' ||
        (n['Node Type'] === 'Bitmap Index Scan' && String(n['Index Name']).startsWith('runs_')),
    );
    // Runs past their deadline in the index's order; then (only when those left room) runs claimed
    // ahead and never started, chosen through the same index (an index or a bitmap scan) and then
    // looked up by primary key (see SELECT_EXPIRED).
    assert.equal(describeNode(onRuns[0]!), 'Index Scan runs_running_idx', `${name}: ${shown}`);
    for (const scan of onRuns.slice(1)) {
      if (scan['Node Type'] === 'Bitmap Heap Scan') continue; // its Bitmap Index Scan is checked
      // The never-started candidates are chosen through the index, then looked up by key.
      assert.ok(['runs_running_idx', 'runs_pkey'].includes(String(scan['Index Name'])), `${name}: ${shown}`);
    }
  }
});

test('a pass with a batch of runs past their deadline reads about that batch of runs and of jobs, and sorts nothing, whatever the statistics say', async () => {
  const found: string[] = [];
  for (const { name, herd: options } of PLAN_CASES) {
    const all = await planOf(options);
    const read = (relation: string) =>
      all
        .filter((n) => n['Relation Name'] === relation)
        .reduce((sum, n) => sum + Number(n['Actual Rows']) * Number(n['Actual Loops'] ?? 1), 0);
    // A sort that ran: the never-started runs' branch sorts what it finds, and runs only when the
    // runs past their deadline did not fill the batch (not here: each case has more than a batch).
    const sorted = all.some((n) => n['Node Type'] === 'Sort' && Number(n['Actual Loops'] ?? 0) > 0);
    if (read('runs') > 200 || read('jobs') > 200 || sorted) {
      found.push(
        `${name}: ${read('runs')} runs, ${read('jobs')} jobs read${sorted ? ', sorted' : ''} (${all.map(describeNode).join(' > ')})`,
      );
    }
  }
  assert.deepEqual(found, []);
});

// A pass holds the fence row from its first statement to its commit, and every dispatch pass of
// the epoch waits for that row meanwhile. A pass's statement that waits or runs long (a lock taken
// by a migration or by hand; a bad plan, see reaper-stale-statistics.test.ts) must give the fence
// back at the reaper's statement timeout, not at the pool's 30 s. Here the pass buries a run, and
// its dead letter waits for a lock on dead_letters, which no dispatch pass touches.

/** A leader write of the same epoch as the reaper's (a dispatch pass's fence and a statement). */
const dispatchPass = () => inFencedTransaction(pool, fakeLeadership(), (c) => c.query('SELECT 1'));

async function blockDeadLetters() {
  const holder = await openTransaction();
  await holder.client.query('LOCK TABLE dead_letters IN EXCLUSIVE MODE');
  return holder;
}

async function untilWaitingOnDeadLetters() {
  await waitFor(
    'the pass waiting for the dead_letters lock',
    async () =>
      (
        await pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM pg_locks
           WHERE NOT granted AND relation = 'dead_letters'::regclass`,
        )
      ).rows[0]!.n > 0,
    5000,
    10,
  );
}

/** `count` runs of `jobId` claimed ahead by a frozen worker, never started, due a minute ago, the claim good for an hour. */
async function neverStartedRuns(jobId: string, count: number): Promise<string[]> {
  const { rows } = await pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before, claimed_by, claim_expires_at)
     SELECT j.id, now() - interval '1 minute' + g * interval '1 millisecond', 'running', 1, 3, j.target,
            j.timeout_ms, 0, 1, 'allow', now() - interval '1 minute', 'frozen-worker', now() + interval '1 hour'
     FROM jobs j, generate_series(1, $2) AS g WHERE j.id = $1
     RETURNING id`,
    [jobId, count],
  );
  return rows.map((r) => r.id);
}

test('a pass held up by a lock is cancelled at its statement timeout and gives the fence row back to dispatch; the run is buried once after', async () => {
  const job = await makeJob(1);
  const [dying] = await expiredRuns(job, 1, { agoMs: 1000, burial: true });
  const [ahead] = await neverStartedRuns(await makeJob(3), 1);
  const holder = await blockDeadLetters();
  const r = reaper({ statementTimeoutMs: 500, unstartedAfterMs: 5000 });
  const pass = r.reapBatch().then(
    () => assert.fail('the pass ended although its dead letter could not be written'),
    (err: unknown) => err,
  );
  await untilWaitingOnDeadLetters();
  const dispatch = await within(dispatchPass(), 2000, 'a dispatch pass behind the held reaper pass');
  const err = await pass;
  assert.match(String(err), /charge statement ran past 500 ms and was cancelled/);
  assert.doesNotMatch(
    String(err),
    /left out/,
    'never-started claims held back for a lock on another statement',
  );
  assert.deepEqual(
    await states([dying!, ahead!]),
    ['running', 'running'],
    'the cancelled pass wrote nothing',
  );
  assert.equal((await lettersOf([dying!])).size, 0);
  await holder.end();
  assert.deepEqual(await r.reapBatch(), { reaped: 2, full: false });
  assert.deepEqual(await states([dying!, ahead!]), ['dead', 'queued']);
  assert.equal((await lettersOf([dying!])).get(dying!), 1, 'one dead letter');
  assert.ok(dispatch.ms >= 300, `the dispatch pass waited ${dispatch.ms} ms: it did not meet the held pass`);
});

test("control: with the pool's statement timeout, a dispatch pass waits for the held reaper pass as long as the lock is held", async () => {
  const job = await makeJob(1);
  const [dying] = await expiredRuns(job, 1, { agoMs: 1000, burial: true });
  const holder = await blockDeadLetters();
  const pass = reaper({ statementTimeoutMs: 30_000 }).reapBatch();
  await untilWaitingOnDeadLetters();
  const dispatch = dispatchPass();
  const stalled = await Promise.race([dispatch.then(() => false), sleep(2000).then(() => true)]);
  await holder.end();
  await within(dispatch, 3000, 'the dispatch pass once the lock was let go');
  assert.deepEqual((await within(pass, 3000, 'the reaper pass')).value, { reaped: 1, full: false });
  assert.deepEqual(await states([dying!]), ['dead']);
  assert.ok(stalled, 'the dispatch pass did not wait for the held reaper pass: the first test shows nothing');
});

test('a pass charging runs commits what it did after its budget (1 s) instead of running on; the next passes take the rest', async () => {
  const job = await makeJob(1);
  const dying = await expiredRuns(job, 30, { agoMs: 1000, burial: true });
  // Each dead letter takes 60 ms: 30 burials would hold the fence row 1.8 s.
  await pool.query(`CREATE FUNCTION slow_letter() RETURNS trigger LANGUAGE plpgsql AS
                      $$ BEGIN PERFORM pg_sleep(0.06); RETURN NEW; END $$`);
  await pool.query(
    `CREATE TRIGGER slow_letter BEFORE INSERT ON dead_letters FOR EACH ROW EXECUTE FUNCTION slow_letter()`,
  );
  try {
    const metrics = createMetrics('test');
    const r = reaper({ metrics });
    const first = await within(r.reapBatch(), 5000, 'the first pass');
    assert.equal(first.value.full, true, 'the pass says more is waiting');
    assert.ok(
      first.value.reaped >= 10 && first.value.reaped < 30,
      `the first pass buried ${first.value.reaped}`,
    );
    assert.ok(first.ms < 1500, `the first pass took ${Math.round(first.ms)} ms`);
    assert.deepEqual(await passesCut(metrics), { budget: 1 });
    while ((await r.reapBatch()).full);
    await assertBuriedOnce(dying);
  } finally {
    await pool.query('DROP TRIGGER slow_letter ON dead_letters');
    await pool.query('DROP FUNCTION slow_letter()');
  }
});

test('after a pass cancelled while taking never-started claims, the passes of this node leave those out for a while, in its next epoch too, and recover the claims past their deadline', async () => {
  // Claims ahead of a job a command holds: the candidates' scan tries each one's job and skips it,
  // which takes longer than the 100 ms limit here (as a bad plan took seconds).
  const held = await makeJob(3);
  await neverStartedRuns(held, 100_000);
  const command = await openTransaction();
  await command.client.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [held]);
  const free = await makeJob(3);
  const [stranded] = await expiredRuns(free, 1, { agoMs: 1000, burial: false });
  // Claimed ahead, never started, and now past its deadline too: taken during the hold as a claim
  // past its deadline, and forgiven as one that never started (no call was made), though its
  // forgiven expiries are used up and it has one attempt: charged, it would be dead.
  const [unstarted] = await neverStartedRuns(free, 1);
  await pool.query(
    `UPDATE runs SET claim_expires_at = now() - interval '1 second', expiries = $2, max_attempts = 1 WHERE id = $1`,
    [unstarted, FORGIVEN_EXPIRIES],
  );

  const hold = new UnstartedClaimsHold();
  const metrics = createMetrics('test');
  const options = { statementTimeoutMs: 100, unstartedAfterMs: 5000, unstartedHold: hold, metrics };
  const r = reaper(options);
  await assert.rejects(
    r.reapBatch(),
    /select statement ran past 100 ms and was cancelled.*never started are left out for 5000 ms/,
  );
  assert.deepEqual(await passesCut(metrics), { statement_timeout: 1 });
  assert.deepEqual(
    await states([stranded!, unstarted!]),
    ['running', 'running'],
    'the cancelled pass wrote nothing',
  );
  assert.deepEqual(await r.reapBatch(), { reaped: 2, full: false });
  assert.deepEqual(
    await states([stranded!, unstarted!]),
    ['queued', 'queued'],
    'the claims past their deadline recovered',
  );
  const { rows } = await pool.query<{ attempt: number; expiries: number; max_attempts: number }>(
    'SELECT attempt, expiries, max_attempts FROM runs WHERE id = $1',
    [unstarted],
  );
  assert.deepEqual(
    rows[0],
    { attempt: 1, expiries: FORGIVEN_EXPIRIES, max_attempts: 2 },
    'the never-started claim was forgiven, its expiry not counted',
  );
  assert.equal((await lettersOf([unstarted!])).size, 0);
  // The node's next epoch (a new Reaper, the same hold) keeps leaving them out.
  assert.deepEqual(await reaper(options).reapBatch(), { reaped: 0, full: false });
  // Control: a reaper that did not meet the timeout (another node) still takes the never-started
  // claims, and its pass is cancelled as the first was.
  await assert.rejects(
    reaper({ statementTimeoutMs: 100, unstartedAfterMs: 5000 }).reapBatch(),
    /ran past 100 ms/,
  );
});

test('a pass filled by claims past their deadline skipped the scan of never-started ones: it does not restart the doubling of the hold', async () => {
  const held = await makeJob(3);
  await neverStartedRuns(held, 100_000);
  const command = await openTransaction();
  await command.client.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [held]);
  const hold = new UnstartedClaimsHold(50);
  const options = { statementTimeoutMs: 100, unstartedAfterMs: 5000, unstartedHold: hold };
  await assert.rejects(reaper(options).reapBatch(), /left out for 50 ms/);
  await sleep(60);
  // A dead worker's calls, more than a batch (100): the pass takes a batch of them and skips the
  // slow scan (a longer timeout only so that forgiving them is not cut).
  await expiredRuns(await makeJob(3), 150, { agoMs: 1000, burial: false });
  assert.deepEqual(await reaper({ ...options, statementTimeoutMs: 2000 }).reapBatch(), {
    reaped: 100,
    full: true,
  });
  // The next pass (50 left past their deadline) runs the scan again, the plan still bad.
  await assert.rejects(reaper(options).reapBatch(), /left out for 100 ms/);
});

test("a pass's wait for the fence row is not cut by its statement timeout: it holds nothing yet, and at a takeover it waits for the old leader's transaction", async () => {
  const holder = await openTransaction();
  await holder.client.query('SELECT token FROM leader_fence WHERE id FOR UPDATE');
  const pass = reaper({ statementTimeoutMs: 200 }).reapBatch();
  await sleep(600);
  await holder.end();
  assert.deepEqual((await within(pass, 3000, 'the pass once the fence row was let go')).value, {
    reaped: 0,
    full: false,
  });
});
