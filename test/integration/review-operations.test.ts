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
