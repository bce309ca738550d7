import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import pg from 'pg';
import { DELETE_HISTORY_BATCH } from '../../src/jobs/commands.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';
import { untilWaitingForLocks } from '../support/execution.js';

// DELETE /jobs/{id} deletes a job's history in batches before the job (jobs/commands.ts deleteJob):
// its interleavings with a dead-letter replay and with a rename.

let api: TestApi;
before(async () => {
  api = await startTestApi();
});
after(() => api.close());

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function createJob(name: string): Promise<string> {
  const created = await api.call('POST', '/api/v1/jobs', { body: jobBody(name, { enabled: false }) });
  assert.equal(created.status, 201, created.text);
  return (created.body as { id: string }).id;
}

/** `n` succeeded runs of job `id`, scheduled `offset + 1 .. offset + n` hours ago. */
async function finishedRuns(id: string, n: number, state = 'succeeded', offsetHours = 0): Promise<void> {
  await api.db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before, finished_at)
     SELECT j.id, now() - ($4::int + s) * interval '1 hour', $3, 1, 1, j.target, 1000, 0, 1,
            now() - ($4::int + s) * interval '1 hour', now()
     FROM jobs j, generate_series(1, $2::int) s WHERE j.id = $1`,
    [id, n, state, offsetHours],
  );
}

/**
 * Runs `action` before each statement matching `pattern` that the API's pool sends, on a client
 * checked out of it (pool.query checks one out through connect too). Returns the undo.
 */
function beforeStatement(pattern: RegExp, action: () => Promise<void>): () => void {
  type Done = (err?: Error | boolean) => void;
  type Callback = (err: Error | undefined, client: pg.PoolClient | undefined, done: Done) => void;
  const pool = api.db.pool;
  const connect = pool.connect;
  const hook = (client: pg.PoolClient) => {
    const query = client.query;
    const release = client.release;
    client.query = (async (...args: unknown[]) => {
      if (typeof args[0] === 'string' && pattern.test(args[0])) await action();
      return (query as (...a: unknown[]) => unknown).apply(client, args);
    }) as typeof client.query;
    client.release = ((err?: Error | boolean) => {
      client.query = query;
      client.release = release;
      return release.call(client, err);
    }) as typeof client.release;
    return client;
  };
  pool.connect = ((callback?: Callback) => {
    const original = connect as unknown as (cb?: Callback) => Promise<pg.PoolClient> | undefined;
    if (!callback) return original.call(pool)!.then(hook);
    return original.call(pool, (err, client, done) => callback(err, client && hook(client), done));
  }) as unknown as typeof pool.connect;
  return () => {
    pool.connect = connect;
  };
}

test('a dead-letter replay racing DELETE /jobs/{id}: both go through (the job lock used to serialise them)', async () => {
  const jobId = await createJob('replay-vs-delete');
  // One dead run with an open dead letter, the newest of the history; a full batch of older
  // succeeded runs before it, so the first history batch commits before the one holding the dead run.
  await finishedRuns(jobId, 1, 'dead', 0);
  await finishedRuns(jobId, DELETE_HISTORY_BATCH, 'succeeded', 10);
  const { rows } = await api.db.pool.query<{ id: string }>(
    `INSERT INTO dead_letters (run_id, job_id, attempt) SELECT id, job_id, 1 FROM runs
     WHERE job_id = $1 AND state = 'dead' RETURNING id`,
    [jobId],
  );
  const letterId = rows[0]!.id;

  // The replay, as POST /dead-letters/{id}/replay runs it, held after it marked the dead letter
  // (its second statement) until the delete waits for a lock.
  const replayPool = new pg.Pool({ connectionString: api.db.url, max: 2, options: '-c TimeZone=UTC' });
  let releaseReplay!: () => void;
  const replayGate = new Promise<void>((r) => (releaseReplay = r));
  const held = {
    query: replayPool.query.bind(replayPool),
    connect: async () => {
      const client = await replayPool.connect();
      const query = client.query.bind(client) as (...a: unknown[]) => Promise<unknown>;
      const original = client.query;
      client.query = (async (...args: unknown[]) => {
        const result = await query(...args);
        if (typeof args[0] === 'string' && args[0].includes('SET replayed_at')) await replayGate;
        return result;
      }) as typeof client.query;
      const release = client.release.bind(client);
      client.release = ((err?: Error | boolean) => {
        client.query = original;
        return release(err);
      }) as typeof client.release;
      return client;
    },
  } as unknown as pg.Pool;
  try {
    const replay = replayDeadLetter(held, letterId, { runsTopic: api.runsTopic }).then(
      (r) => ({ ok: r, err: null as null | string }),
      (e: { code?: string; message: string }) => ({ ok: null, err: `${e.code} ${e.message}` }),
    );
    // Let the replay take its dead letter.
    for (let i = 0; i < 100; i++) {
      const marked = await api.db.pool.query(
        `SELECT 1 FROM pg_stat_activity WHERE query LIKE '%SET replayed_at%' AND datname = current_database()
           AND pid <> pg_backend_pid()`,
      );
      if (marked.rowCount) break;
      await sleep(20);
    }
    const deleting = api.call('DELETE', `/api/v1/jobs/${jobId}`);
    // Once the delete waits for a lock (the replay's), let the replay go on.
    let waited = false;
    for (let i = 0; i < 250 && !waited; i++) {
      const waiting = await api.db.pool.query(
        `SELECT 1 FROM pg_stat_activity
         WHERE wait_event_type = 'Lock' AND query ~ '(DELETE FROM (runs|jobs)|FROM jobs WHERE id = [$]1 FOR UPDATE)'
           AND datname = current_database()
           AND pid <> pg_backend_pid()`,
      );
      waited = (waiting.rowCount ?? 0) > 0;
      if (!waited) await sleep(20);
    }
    releaseReplay();
    const [deleted, replayed] = await Promise.all([deleting, replay]);
    const left = await api.db.pool.query<{ runs: number; job: number }>(
      `SELECT (SELECT count(*) FROM runs WHERE job_id = $1)::int AS runs,
              (SELECT count(*) FROM jobs WHERE id = $1)::int AS job`,
      [jobId],
    );
    assert.deepEqual(
      {
        deleteStatus: deleted.status,
        deleteDetail: (deleted.body as { detail?: string } | null)?.detail ?? null,
        replayError: replayed.err,
        left: left.rows[0],
      },
      { deleteStatus: 204, deleteDetail: null, replayError: null, left: { runs: 0, job: 0 } },
      `the delete waited for a lock: ${waited}`,
    );
  } finally {
    releaseReplay();
    await replayPool.end();
  }
});

test('DELETE /jobs/{name} deletes the job of that name, not one renamed while its history went', async () => {
  const doomed = await createJob('delete-by-name');
  await finishedRuns(doomed, 5);
  let raced = false;
  let renamed = 0;
  let recreated = 0;
  // Before a history batch locks the job (the rename waits for that lock).
  const unhook = beforeStatement(/FROM jobs WHERE id = \$1 FOR UPDATE/, async () => {
    if (raced) return;
    raced = true;
    // Meanwhile: the job is renamed, and a new job takes its old name.
    renamed = (await api.call('PATCH', `/api/v1/jobs/${doomed}`, { body: { name: 'renamed-meanwhile' } }))
      .status;
    recreated = (
      await api.call('POST', '/api/v1/jobs', { body: jobBody('delete-by-name', { enabled: false }) })
    ).status;
  });
  const status = await api
    .call('DELETE', '/api/v1/jobs/delete-by-name')
    .then((response) => response.status)
    .finally(unhook);
  assert.deepEqual([raced, renamed, recreated], [true, 200, 201]);
  const byOldName = (await api.call('GET', '/api/v1/jobs/delete-by-name')).status;
  const byNewName = (await api.call('GET', '/api/v1/jobs/renamed-meanwhile')).status;
  // Linearizable answers: 204 with "delete-by-name" gone (the new job deleted) and the renamed job
  // kept, or 404 with both kept. A 204 that deleted the job now called "renamed-meanwhile" while
  // "delete-by-name" still exists is neither.
  assert.ok(
    (status === 204 && byOldName === 404 && byNewName === 200) ||
      (status === 404 && byOldName === 200 && byNewName === 200),
    `DELETE /jobs/delete-by-name answered ${status}; then GET /jobs/delete-by-name ${byOldName}, GET /jobs/renamed-meanwhile ${byNewName}`,
  );
});

test("a prune racing DELETE /jobs/{id} does not cut the delete's history batches short", async () => {
  // The leader's pruner deletes a job's oldest finished runs, the very ones a delete's first history
  // batch picks. A batch that found some gone (the pruner's, committed while the batch waited for
  // their rows) deleted fewer than a batch, and the delete took that for the end of the history:
  // the job row's cascade then took every run left in one statement, the one the batches keep
  // within the statement timeout (an every-second job kept 30 days has 2.6M).
  const jobId = await createJob('prune-vs-delete');
  const history = DELETE_HISTORY_BATCH * 2 + 500;
  await finishedRuns(jobId, history, 'succeeded', 10);
  const db = api.db.pool;
  // Counts the runs each statement deleted, cascades included (a cascade is one statement).
  await db.query(`CREATE TABLE deleted_runs_by_statement (n int)`);
  await db.query(`CREATE FUNCTION count_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN INSERT INTO deleted_runs_by_statement SELECT count(*) FROM gone; RETURN NULL; END $$`);
  await db.query(`CREATE TRIGGER count_deleted AFTER DELETE ON runs REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION count_deleted()`);
  // The pruner's statement, in flight: it holds the job's oldest run until the batch waits for it.
  const pruner = new pg.Client({ connectionString: api.db.url });
  await pruner.connect();
  let pruned: Promise<void> | undefined;
  const unhook = beforeStatement(/WITH gone AS/, async () => {
    if (pruned) return;
    await pruner.query('BEGIN');
    await pruner.query(
      `DELETE FROM runs WHERE id = (SELECT id FROM runs WHERE job_id = $1 ORDER BY scheduled_for LIMIT 1)`,
      [jobId],
    );
    pruned = (async () => {
      await untilWaitingForLocks(db, { fragment: 'WITH gone AS', everyMs: 1 });
      await pruner.query('COMMIT');
    })();
  });
  try {
    const deleted = await api.call('DELETE', `/api/v1/jobs/${jobId}`);
    assert.equal(deleted.status, 204, deleted.text);
    await pruned;
    const { rows } = await db.query<{ n: number }>(`SELECT n FROM deleted_runs_by_statement WHERE n > 0`);
    const perStatement = rows.map((r) => r.n);
    assert.equal(
      perStatement.reduce((a, b) => a + b, 0),
      history,
      'every run of the job was deleted, once',
    );
    assert.ok(
      perStatement.every((n) => n <= DELETE_HISTORY_BATCH),
      `runs deleted per statement: ${perStatement.join(', ')}`,
    );
  } finally {
    unhook();
    await pruner.end();
    await db.query('DROP TABLE deleted_runs_by_statement; DROP FUNCTION count_deleted CASCADE');
  }
});
