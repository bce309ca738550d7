/**
 * `replace` across versions. A worker that claims a run of a `replace` job fails the job's other
 * running runs, keeping the one "asked for last" (store/runs.ts REPLACE_OLDER). Two workers whose
 * claims commit together each run that statement; when both see both runs running, both must keep
 * the same one, or each fails the other's run and the job is left with none. In a rolling upgrade
 * the two may be of different releases: this runs the old release's statement (its own compiled
 * module, test/support/old-release.ts) and this checkout's against one database, lined up on a
 * row lock so that both read both runs running before either writes.
 *
 * Releases before 5b992af order by scheduled_for; since, a replayed run counts as asked for at its
 * replay (requestedAt). So a replay of an older occurrence racing a newer occurrence's claim
 * divides them: the old statement keeps the newer occurrence, the new one keeps the replay.
 */
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { after, before, test } from 'node:test';
import type pg from 'pg';
import { replaceOlderRuns } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { waitFor } from '../support/execution.js';
import { oldRelease, type OldRelease } from '../support/old-release.js';

const release = oldRelease();
let db: TestDatabase;

before(async () => {
  if (typeof release !== 'string') db = await createTestDatabase();
});
after(async () => {
  await db?.drop();
  if (typeof release !== 'string') release.remove();
});

type ReplaceOlder = typeof replaceOlderRuns;

/** The old release's replaceOlderRuns, from its compiled store module. */
async function oldReplaceOlder(old: OldRelease): Promise<ReplaceOlder> {
  const module = (await import(pathToFileURL(join(old.dir, 'dist/store/runs.js')).href)) as {
    replaceOlderRuns: ReplaceOlder;
  };
  return module.replaceOlderRuns;
}

/**
 * A `replace` job with two running runs: its occurrence 60 s ago, which used up its attempts and
 * was replayed 1 s ago (attempt 2, on worker `new-node`), and its occurrence 10 s ago (attempt 1,
 * on worker `old-node`). Returns the job and the two run ids.
 */
async function replayBesideNewerOccurrence(
  pool: pg.Pool,
): Promise<{ jobId: string; replayed: string; newer: string }> {
  const { rows: jobs } = await pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, backoff_multiplier,
                       concurrency, next_run_at)
     VALUES ('replace-' || gen_random_uuid(), '*/10 * * * * *', '{"url": "http://127.0.0.1:9/"}', 30000, 1,
             100, 2, 'replace', now() + interval '1 hour')
     RETURNING id`,
  );
  const jobId = jobs[0]!.id;
  // $1 = job, $2 = seconds ago, $3 = attempt, $4 = node.
  const insertRunning = `
    WITH run AS (
      INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                        backoff_multiplier, concurrency, not_before, claimed_by, claim_expires_at,
                        created_epoch, started_at)
      SELECT $1, date_trunc('second', now()) - $2::int * interval '1 second', 'running', $3, $3,
             j.target, j.timeout_ms, j.backoff_ms, j.backoff_multiplier, j.concurrency, now(), $4,
             now() + interval '1 minute', 1, now()
      FROM jobs j WHERE j.id = $1
      RETURNING id, attempt
    ), attempt AS (
      INSERT INTO run_attempts (run_id, attempt, node_id) SELECT id, attempt, $4 FROM run
    )
    SELECT id FROM run`;
  const replayed = (await pool.query<{ id: string }>(insertRunning, [jobId, 60, 2, 'new-node'])).rows[0]!.id;
  await pool.query(
    `INSERT INTO dead_letters (run_id, job_id, attempt, error, replayed_at, replay_count)
     VALUES ($1, $2, 1, 'HTTP 500', now() - interval '1 second', 1)`,
    [replayed, jobId],
  );
  const newer = (await pool.query<{ id: string }>(insertRunning, [jobId, 10, 1, 'old-node'])).rows[0]!.id;
  return { jobId, replayed, newer };
}

/**
 * Runs `first` and `second` on the job together: both wait on a lock of the job's running runs
 * until both statements are waiting (each has read the runs it will keep and fail), then go.
 */
async function together(pool: pg.Pool, jobId: string, first: ReplaceOlder, second: ReplaceOlder) {
  const gate = await pool.connect();
  try {
    await gate.query('BEGIN');
    await gate.query(`SELECT id FROM runs WHERE job_id = $1 AND state = 'running' FOR UPDATE`, [jobId]);
    const both = Promise.allSettled([first(pool, jobId), second(pool, jobId)]);
    await waitFor(
      'both replace statements waiting on the runs',
      async () => {
        const { rows } = await pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM pg_stat_activity
           WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%WITH newest AS%'`,
        );
        return rows[0]!.n === 2;
      },
      10_000,
      20,
    );
    await gate.query('COMMIT');
    const answers = await both;
    return answers.map((a) => {
      if (a.status === 'rejected') throw a.reason;
      return a.value;
    });
  } finally {
    gate.release();
  }
}

test(
  "a replay's claim and a newer occurrence's claim on workers of the old and the new release leave one of the two running",
  { skip: typeof release === 'string' ? release : false, timeout: 60_000 },
  async (t) => {
    const old = release as OldRelease;
    t.diagnostic(`old release ${old.commit}`);
    const oldReplace = await oldReplaceOlder(old);
    const { jobId, replayed, newer } = await replayBesideNewerOccurrence(db.pool);
    const [byOld, byNew] = await together(db.pool, jobId, oldReplace, replaceOlderRuns);
    const name = (id: string | undefined) =>
      id === replayed ? 'replayed' : id === newer ? 'newer' : String(id);
    // Each worker calls its run only if its statement answered that run as the one left running.
    t.diagnostic(
      `the old worker's statement kept ${name(byOld!.running?.id)}, failed ${byOld!.replaced.map(name).join(' ')}; ` +
        `the new worker's kept ${name(byNew!.running?.id)}, failed ${byNew!.replaced.map(name).join(' ')}`,
    );
    const { rows } = await db.pool.query<{ id: string; state: string; reason: string | null }>(
      `SELECT id, state, reason FROM runs WHERE job_id = $1`,
      [jobId],
    );
    const states = Object.fromEntries(
      rows.map((r) => [
        r.id === replayed ? 'replayed' : r.id === newer ? 'newer' : r.id,
        `${r.state} ${r.reason ?? ''}`.trim(),
      ]),
    );
    t.diagnostic(JSON.stringify(states));
    assert.equal(
      rows.filter((r) => r.state === 'running').length,
      1,
      `one run of the job is left to call: ${JSON.stringify(states)}`,
    );
  },
);

test(
  'control: two workers of the new release in the same race leave one of the two running',
  { skip: typeof release === 'string' ? release : false, timeout: 60_000 },
  async () => {
    const { jobId } = await replayBesideNewerOccurrence(db.pool);
    await together(db.pool, jobId, replaceOlderRuns, replaceOlderRuns);
    const { rows } = await db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM runs WHERE job_id = $1 AND state = 'running'`,
      [jobId],
    );
    assert.equal(rows[0]!.n, 1);
  },
);
