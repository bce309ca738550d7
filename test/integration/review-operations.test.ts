import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';
import { uniqueId } from '../support/env.js';
import { waitFor } from '../support/execution.js';

// Review of "delete, trigger, pause, PATCH at any moment" (contract item 10) against the real
// database: a DELETE of the job is held open in a transaction of the test, the other operation
// is sent meanwhile and waits for the job row, and then the DELETE commits. Whatever the order,
// the caller must get an answer that says what happened (404: the job is gone), never a 500.

let api: TestApi;
before(async () => {
  api = await startTestApi();
});
after(() => api.close());

async function createJob(): Promise<string> {
  const response = await api.call('POST', '/api/v1/jobs', { body: jobBody(`race-${uniqueId()}`) });
  assert.equal(response.status, 201, response.text);
  return (response.body as { id: string }).id;
}

/** Runs `operation` while a DELETE of the job is uncommitted; commits the DELETE once it waits. */
async function whileDeleting(jobId: string, operation: () => Promise<{ status: number; text: string }>) {
  const deleter = await api.db.pool.connect();
  try {
    await deleter.query('BEGIN');
    await deleter.query('DELETE FROM jobs WHERE id = $1', [jobId]);
    const answer = operation();
    // The operation's statement is blocked on the row the DELETE holds.
    await waitFor('the operation to wait for the job row', async () => {
      const { rows } = await api.db.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> $1`,
        [(await deleter.query<{ pid: number }>('SELECT pg_backend_pid() AS pid')).rows[0]!.pid],
      );
      return rows[0]!.n > 0;
    });
    await deleter.query('COMMIT');
    return await answer;
  } finally {
    deleter.release();
  }
}

test('a trigger racing a delete of its job answers 404, not 500', async () => {
  const jobId = await createJob();
  const answer = await whileDeleting(jobId, () => api.call('POST', `/api/v1/jobs/${jobId}/trigger`));
  assert.ok([404, 409].includes(answer.status), `trigger racing a delete: ${answer.status} ${answer.text}`);
});

test('a pause racing a delete of its job answers 404', async () => {
  const jobId = await createJob();
  const answer = await whileDeleting(jobId, () => api.call('POST', `/api/v1/jobs/${jobId}/pause`));
  assert.equal(answer.status, 404, answer.text);
});

test('a PATCH racing a delete of its job answers 404', async () => {
  const jobId = await createJob();
  const answer = await whileDeleting(jobId, () =>
    api.call('PATCH', `/api/v1/jobs/${jobId}`, { body: { schedule: '*/7 * * * *' } }),
  );
  assert.equal(answer.status, 404, answer.text);
});

test('a replay racing a delete of its job: neither call fails with 500', async () => {
  const jobId = await createJob();
  const { rows } = await api.db.pool.query<{ runId: string; letterId: string }>(
    `WITH run AS (
       INSERT INTO runs (job_id, scheduled_for, trigger, state, attempt, max_attempts, target, timeout_ms,
                         backoff_ms, backoff_multiplier, concurrency, not_before, finished_at)
       SELECT id, now() - interval '1 minute', 'manual', 'dead', 1, 1, target, timeout_ms, backoff_ms,
              backoff_multiplier, concurrency, now() - interval '1 minute', now()
       FROM jobs WHERE id = $1
       RETURNING id, job_id)
     INSERT INTO dead_letters (run_id, job_id, attempt, error)
     SELECT id, job_id, 1, 'review' FROM run
     RETURNING run_id AS "runId", id AS "letterId"`,
    [jobId],
  );
  const { runId, letterId } = rows[0]!;
  // The test holds the run row, so that the DELETE (job row, then its runs by cascade) waits on it
  // first and the replay (dead letter row, then the run) queues behind it: once the run is let go,
  // the DELETE takes it and cascades on to the dead letter the replay holds, while the replay waits
  // for the run the DELETE now holds.
  const holder = await api.db.pool.connect();
  const waiting = async (n: number) =>
    waitFor(`${n} sessions to wait for a lock`, async () => {
      const { rows: w } = await api.db.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'`,
      );
      return w[0]!.n >= n;
    });
  let deleted: Promise<{ status: number; text: string }>;
  let replayed: Promise<{ status: number; text: string }>;
  try {
    await holder.query('BEGIN');
    await holder.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE', [runId]);
    deleted = api.call('DELETE', `/api/v1/jobs/${jobId}`);
    await waiting(1);
    replayed = api.call('POST', `/api/v1/dead-letters/${letterId}/replay`);
    await waiting(2);
    await holder.query('COMMIT');
  } finally {
    holder.release();
  }
  const [d, r] = await Promise.all([deleted, replayed]);
  const deadlocks = api.logs.filter((l) => l.includes('deadlock detected')).length;
  assert.ok(
    d.status !== 500 && r.status !== 500,
    `DELETE ${d.status} ${d.text}; replay ${r.status} ${r.text}; deadlocks logged: ${deadlocks}`,
  );
  // The delete takes the job's row first, as the replay does, so the two queue rather than
  // deadlock (a 409 after deadlock_timeout).
  assert.equal(deadlocks, 0, `DELETE ${d.status}; replay ${r.status}`);
  assert.equal(d.status, 204, d.text);
});
