import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import type pg from 'pg';
import { deleteJob, patchJob, pauseJob } from '../../src/jobs/commands.js';
import { parseCron } from '../../src/scheduling/cron.js';
import { completeSucceededMany, releaseClaim, selectExpiredRuns } from '../../src/store/attempts.js';
import { forgiveExpiredClaims } from '../../src/store/releases.js';
import { inTransaction } from '../../src/store/db.js';
import { createRuns } from '../../src/store/dispatch.js';
import type { JobRecord } from '../../src/store/jobs.js';
import { claimRuns, startRuns, type ClaimedRun, type ClaimOptions } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { untilWaitingForLocks, waitFor } from '../support/execution.js';
import { dbNow, untilDbTime } from '../support/db-time.js';

// Interleavings of START (startRuns) with the other writers of a run
// claimed ahead of its time, through the real commands (pauseJob, patchJob, deleteJob), the
// dispatcher's createRuns, the reaper's forgiven expiry and a stopping worker's release.

let db: TestDatabase;
const NODE = 'node-a';
const OTHER = 'node-b';
const COMMANDS = { runsTopic: 'runs', misfireThresholdMs: 5000 };
const ahead = (nodeId = NODE, extra: Partial<ClaimOptions> = {}): ClaimOptions => ({
  nodeId,
  graceMs: 5000,
  skewToleranceMs: 10,
  leadMs: 600_000,
  ...extra,
});
const report = (error: string, outcome: 'cancelled' | 'expired' = 'cancelled') => ({
  outcome,
  statusCode: null,
  durationMs: null,
  error,
  responseExcerpt: null,
});

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** An enabled every-second job whose next_run_at is far ahead (its runs are made by the test). */
async function makeJob(opts: { concurrency?: string; timeoutMs?: number; nextRunAt?: string } = {}) {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, concurrency, next_run_at)
     VALUES ('rw-' || gen_random_uuid(), '* * * * * *', '{"url":"http://127.0.0.1:9/old"}', $1, 3, $2,
             ${opts.nextRunAt ?? "now() + interval '1 hour'"}) RETURNING id`,
    [opts.timeoutMs ?? 1000, opts.concurrency ?? 'allow'],
  );
  return rows[0]!.id;
}

/** A queued run of `jobId` due at `at` (SQL), as the dispatcher creates it, from the job. */
async function makeRun(jobId: string, at: string): Promise<{ id: string; scheduledFor: Date }> {
  const { rows } = await db.pool.query<{ id: string; scheduledFor: Date }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, t, 'queued', j.max_attempts, j.target, j.timeout_ms, 100, 2, j.concurrency, t
     FROM jobs j, (SELECT ${at} AS t) s WHERE j.id = $1
     RETURNING id, scheduled_for AS "scheduledFor"`,
    [jobId],
  );
  return rows[0]!;
}

async function claim(id: string, options = ahead(), expected: number | null = null): Promise<ClaimedRun> {
  const [run] = await claimRuns(db.pool, [{ runId: id, expectedAttempt: expected }], options);
  assert.ok(run, `run ${id} claimed`);
  return run;
}

async function runsOf(jobId: string) {
  const { rows } = await db.pool.query<{
    id: string;
    state: string;
    attempt: number;
    url: string;
    startedAt: Date | null;
    scheduledFor: Date;
  }>(
    `SELECT id, state, attempt, target->>'url' AS url, started_at AS "startedAt",
            scheduled_for AS "scheduledFor"
     FROM runs WHERE job_id = $1 ORDER BY scheduled_for`,
    [jobId],
  );
  return rows;
}

const newTarget = (current: JobRecord) => ({
  fields: { ...current, target: { url: 'http://127.0.0.1:9/new', method: 'GET', headers: {} } },
  schedule: parseCron(current.schedule, current.timezone),
});

test('edit withdraws a claimed-ahead run; the dispatcher re-creates the occurrence; only the new run can start', async () => {
  const jobId = await makeJob();
  const old = await makeRun(jobId, "date_trunc('second', now()) + interval '30 seconds'");
  const oldClaim = await claim(old.id);
  assert.equal(oldClaim.startPending, true);
  const edited = await patchJob(db.pool, { id: jobId }, newTarget, COMMANDS);
  assert.ok(edited!.nextRunAt! <= old.scheduledFor, 'the edit asks the dispatcher for the occurrence again');
  // The dispatcher re-creates the occurrence (same unique key): not blocked by the old run.
  assert.equal(await createRuns(db.pool, [{ jobId, scheduledFor: old.scheduledFor }], null, 'runs'), 1);
  const [fresh] = await runsOf(jobId);
  assert.equal(fresh!.url, 'http://127.0.0.1:9/new');
  const freshClaim = await claim(fresh!.id, ahead(OTHER));
  // The old worker's START comes at the occurrence's time, with the new run's.
  assert.deepEqual(await startRuns(db.pool, NODE, [oldClaim]), [false], 'the withdrawn run is not called');
  assert.deepEqual(await startRuns(db.pool, OTHER, [freshClaim]), [true], 'the new run is called');
  assert.equal((await runsOf(jobId)).length, 1, 'one run for the occurrence');
});

test('edit after START: the started run is kept, the dispatcher cannot create the occurrence twice', async () => {
  const jobId = await makeJob();
  const run = await makeRun(jobId, "date_trunc('second', now()) + interval '2 seconds'");
  const claimed = await claim(run.id);
  assert.equal(claimed.startPending, true);
  await untilDbTime(db.pool, run.scheduledFor);
  assert.deepEqual(await startRuns(db.pool, NODE, [claimed]), [true]);
  const edited = await patchJob(db.pool, { id: jobId }, newTarget, COMMANDS);
  assert.ok(edited);
  assert.equal(await createRuns(db.pool, [{ jobId, scheduledFor: run.scheduledFor }], null, 'runs'), 0);
  const rows = await runsOf(jobId);
  assert.equal(rows.length, 1);
  assert.equal(rows[0]!.url, 'http://127.0.0.1:9/old', 'due before the edit: the old definition');
});

test('released uncalled by a stopping worker, re-claimed ahead elsewhere (attempt 2): a pause withdraws it, neither START succeeds', async () => {
  const jobId = await makeJob();
  const run = await makeRun(jobId, "date_trunc('second', now()) + interval '30 seconds'");
  const first = await claim(run.id);
  const next = await inTransaction(db.pool, (c) => releaseClaim(c, first, NODE, report('stopping'), 'runs'));
  assert.equal(next?.attempt, 2);
  const second = await claim(run.id, ahead(OTHER), 2);
  assert.equal(second.startPending, true, 'the re-claim ahead still waits for START');
  const paused = await pauseJob(db.pool, { id: jobId }, COMMANDS);
  assert.equal(paused?.enabled, false);
  assert.deepEqual(await runsOf(jobId), [], 'withdrawn');
  const { rows } = await db.pool.query('SELECT 1 FROM run_attempts WHERE run_id = $1', [run.id]);
  assert.equal(rows.length, 0, 'its attempts went with it');
  assert.deepEqual(await startRuns(db.pool, OTHER, [second]), [false]);
  assert.deepEqual(await startRuns(db.pool, NODE, [first]), [false]);
});

test('claimed ahead, START never written (failed, or the worker died): reaper forgives after its time, a later pause keeps it, it is claimed when due without START', async () => {
  const jobId = await makeJob({ timeoutMs: 100 });
  const run = await makeRun(jobId, "clock_timestamp() + interval '700 milliseconds'");
  const claimed = await claim(run.id, ahead(NODE, { graceMs: 100 }));
  assert.equal(claimed.startPending, true);
  await untilDbTime(db.pool, new Date(claimed.claimExpiresAt.getTime() + 20));
  const forgiven = await inFencelessReap();
  assert.equal(forgiven, 1, 'the expired claim was forgiven');
  const paused = await pauseJob(db.pool, { id: jobId }, COMMANDS);
  assert.equal(paused?.enabled, false);
  const [left] = await runsOf(jobId);
  assert.ok(left, 'due before the pause: not withdrawn (it is owed)');
  assert.equal(left.state, 'queued');
  assert.equal(left.startedAt, null);
  const again = await claim(run.id, ahead(OTHER));
  assert.equal(again.startPending, false, 'claimed once due: started by its claim');
  assert.deepEqual(await startRuns(db.pool, NODE, [claimed]), [false], "the first worker's late START loses");
});

/** The reaper's pass without the fence (selectExpiredRuns + forgiveExpiredClaims). */
async function inFencelessReap(): Promise<number> {
  return inTransaction(db.pool, async (c: pg.PoolClient) => {
    let n = 0;
    for (const run of await selectExpiredRuns(c, 100)) {
      if ((await forgiveExpiredClaims(c, [{ run, error: 'expired' }], 2, 'runs'))[0]) n += 1;
    }
    return n;
  });
}

test('a job deleted while its run is claimed ahead: START finds nothing', async () => {
  const jobId = await makeJob();
  const run = await makeRun(jobId, "date_trunc('second', now()) + interval '30 seconds'");
  const claimed = await claim(run.id);
  assert.equal(await deleteJob(db.pool, { id: jobId }), true);
  assert.deepEqual(await startRuns(db.pool, NODE, [claimed]), [false]);
});

test('a replace (or forbid) run claimed within the skew tolerance before its time is startPending', async () => {
  // Precondition of the unit test "a replace run withdrawn before its START ...": replace runs are
  // "claimed only when due", but the claim admits them skewToleranceMs early (up to 10 s by
  // HELIOS_CLOCK_SKEW_TOLERANCE_MS), and then its started_at stays NULL.
  for (const concurrency of ['replace', 'forbid']) {
    const jobId = await makeJob({ concurrency });
    const run = await makeRun(jobId, "clock_timestamp() + interval '5 seconds'");
    const claimed = await claim(run.id, ahead(NODE, { skewToleranceMs: 10_000, leadMs: 0 }));
    assert.equal(claimed.startPending, true, `${concurrency}: withdrawable until START`);
  }
});

test('a completion batch with a stale attempt and the current one of the same run records each report on its own attempt', async () => {
  const jobId = await makeJob({ timeoutMs: 100 });
  const run = await makeRun(jobId, 'clock_timestamp()');
  const first = await claim(run.id, ahead(NODE, { graceMs: 100 }));
  assert.equal(first.startPending, false);
  await untilDbTime(db.pool, new Date(first.claimExpiresAt.getTime() + 20));
  assert.equal(await inFencelessReap(), 1);
  const second = await claim(run.id, ahead(NODE), 2);
  const ok = (status: number) => ({
    outcome: 'succeeded' as const,
    statusCode: status,
    durationMs: status,
    error: null,
    responseExcerpt: `r${status}`,
  });
  const done = await completeSucceededMany(db.pool, NODE, [
    { run: first, report: ok(201) },
    { run: second, report: ok(202) },
  ]);
  assert.deepEqual(done, [false, true]);
  const { rows } = await db.pool.query<{
    attempt: number;
    outcome: string;
    status: number | null;
    excerpt: string | null;
  }>(
    `SELECT attempt, outcome, status_code AS status, response_excerpt AS excerpt
     FROM run_attempts WHERE run_id = $1 ORDER BY attempt`,
    [run.id],
  );
  assert.deepEqual(rows, [
    { attempt: 1, outcome: 'expired', status: null, excerpt: null },
    { attempt: 2, outcome: 'succeeded', status: 202, excerpt: 'r202' },
  ]);
});

test("a pause whose boundary precedes an occurrence does not let that occurrence's claimed-ahead run be called", async () => {
  // Had the pause drawn its line (clock_timestamp() once the job is locked) a statement or more
  // before its delete (createDueRuns sits in between), a START committed in between, for an
  // occurrence due after the line, would be kept by the delete (started_at set) and called: a paused
  // job's occurrence after the pause's line would run, and the pause's answer (updated_at, nextRunAt)
  // would say otherwise. The delete draws the line itself (WITHDRAW_FUTURE_RUNS). Here createDueRuns
  // is held up (the dispatcher lagged, so the pause creates a due run, and its outbox insert waits on
  // a lock) to open the window wide.
  const jobId = await makeJob({ nextRunAt: "date_trunc('second', now())" });
  const run = await makeRun(jobId, "date_trunc('second', clock_timestamp()) + interval '2 seconds'");
  const claimed = await claim(run.id);
  assert.equal(claimed.startPending, true);
  const locker = await db.pool.connect();
  await locker.query('BEGIN');
  await locker.query('LOCK TABLE outbox IN SHARE MODE');
  const pausing = pauseJob(db.pool, { id: jobId }, COMMANDS);
  await waitFor('the pause waiting in createDueRuns', async () => {
    const { rows } = await db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM pg_stat_activity
       WHERE datname = current_database() AND wait_event_type = 'Lock'`,
    );
    return rows[0]!.n > 0;
  });
  const boundaryAtMost = await dbNow(db.pool);
  assert.ok(
    run.scheduledFor.getTime() > boundaryAtMost,
    'precondition: the occurrence is after the boundary',
  );
  await untilDbTime(db.pool, run.scheduledFor);
  // START may wait for the pause (which waits for the locker), so the lock goes once it is sent.
  const starting = startRuns(db.pool, NODE, [claimed]);
  await sleep(50);
  await locker.query('COMMIT');
  locker.release();
  const [started] = await starting;
  const paused = await pausing;
  assert.equal(paused?.enabled, false);
  const pausedAt = paused!.updatedAt.getTime();
  assert.ok(pausedAt <= boundaryAtMost);
  assert.ok(
    !started,
    `occurrence ${run.scheduledFor.toISOString()} is after the pause (updated_at ${paused!.updatedAt.toISOString()}, ` +
      `nextRunAt ${paused!.nextRunAt?.toISOString()}) yet its START succeeded and the run was kept ` +
      `(${(await runsOf(jobId)).filter((r) => r.id === run.id).length} row)`,
  );
});

test('pause blocked behind an uncommitted START (real command): the started run is kept; START blocked behind the pause: withdrawn', async () => {
  const jobId = await makeJob();
  const a = await makeRun(jobId, "date_trunc('second', now()) + interval '30 seconds'");
  const claimedA = await claim(a.id);
  const client = await db.pool.connect();
  await client.query('BEGIN');
  assert.deepEqual(await startRuns(client, NODE, [claimedA]), [true]);
  const pausing = pauseJob(db.pool, { id: jobId }, COMMANDS);
  await untilWaitingForLocks(db.pool);
  await client.query('COMMIT');
  client.release();
  await pausing;
  assert.equal((await runsOf(jobId)).length, 1, 'EvalPlanQual re-read started_at on the new version: kept');

  const job2 = await makeJob();
  const b = await makeRun(job2, "date_trunc('second', now()) + interval '30 seconds'");
  const claimedB = await claim(b.id);
  const pauser = await db.pool.connect();
  await pauser.query('BEGIN');
  await pauser.query(`SELECT id FROM jobs WHERE id = $1 FOR UPDATE`, [job2]);
  await pauser.query(
    `DELETE FROM runs WHERE job_id = $1 AND trigger = 'schedule' AND scheduled_for > now()
       AND state IN ('queued', 'running') AND started_at IS NULL`,
    [job2],
  );
  const starting = startRuns(db.pool, NODE, [claimedB]);
  await untilWaitingForLocks(db.pool);
  await pauser.query('COMMIT');
  pauser.release();
  assert.deepEqual(await starting, [false]);
});

test('a START batch holding two runs of one job and a pause lock them in opposite orders: the pause must not fail on a deadlock', async () => {
  // START sorts by run id; the pause's DELETE takes the job's runs in its scan's order (index or
  // heap order, not id order). Two runs of one job share a START batch when the earlier one waited
  // (a slot, a queued batch) until the later one's time. A third transaction holds the row START
  // takes first, briefly, to order the waits deterministically (naturally the same inversion only
  // needs the two statements to interleave). Both id assignments are tried, so one of them inverts
  // the DELETE's order whatever plan it uses.
  const outcomes: string[] = [];
  for (const [earlyId, lateId] of [
    ['ffffffff-0000-4000-8000-000000000001', '00000000-0000-4000-8000-000000000002'],
    ['00000000-0000-4000-8000-000000000003', 'ffffffff-0000-4000-8000-000000000004'],
  ] as const) {
    const jobId = await makeJob();
    const insert = async (id: string, seconds: number) => {
      await db.pool.query(
        `INSERT INTO runs (id, job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                           backoff_multiplier, concurrency, not_before)
         SELECT $1, j.id, t, 'queued', 3, j.target, 1000, 100, 2, 'allow', t
         FROM jobs j, (SELECT date_trunc('second', now()) + $3 * interval '1 second' AS t) s WHERE j.id = $2`,
        [id, jobId, seconds],
      );
      return claim(id);
    };
    const early = await insert(earlyId, 30);
    const late = await insert(lateId, 31);
    const first = early.id < late.id ? early : late;
    const holder = await db.pool.connect();
    await holder.query('BEGIN');
    await holder.query('SELECT 1 FROM runs WHERE id = $1 FOR NO KEY UPDATE', [first.id]);
    const starting = startRuns(db.pool, NODE, [early, late]).then(
      (r) => JSON.stringify(r),
      (err: Error) => `error: ${err.message}`,
    );
    await untilWaitingForLocks(db.pool);
    const pausing = pauseJob(db.pool, { id: jobId }, COMMANDS).then(
      () => 'ok',
      (err: Error) => `error: ${err.message}`,
    );
    await untilWaitingForLocks(db.pool, { count: 2 });
    await holder.query('ROLLBACK');
    holder.release();
    const [start, pause] = await Promise.all([starting, pausing]);
    const left = (await runsOf(jobId)).length;
    outcomes.push(`START ${start}, pause ${pause}, ${left} runs left`);
  }
  assert.ok(
    outcomes.every((o) => o.includes('pause ok')),
    `a pause failed:\n${outcomes.join('\n')}`,
  );
});
