import assert from 'node:assert/strict';
import type pg from 'pg';
import { attemptsOf, insertJob, waitFor } from './execution.js';

/**
 * A job stored without the API (or before the save-time check) whose target is one of the
 * cluster's own servers, `what` (as the refusal names it: `PostgreSQL`, `Kafka controller`, …):
 * triggered through the node's API at `apiUrl`, its worker must refuse the call before any
 * connection, once, and the run end after that one attempt.
 */
export async function assertRefusedAtExecution(
  db: pg.Pool,
  apiUrl: string | null,
  job: { name: string; url: string; what: string },
): Promise<void> {
  assert.ok(apiUrl, 'the node serves its API');
  const jobId = await insertJob(db, {
    name: job.name,
    schedule: '0 0 1 1 *',
    target: { url: job.url, method: 'POST', body: { q: 'x' } },
    maxAttempts: 3,
    backoffMs: 100,
    nextRunAt: new Date(Date.now() + 86_400_000),
  });
  const trigger = await fetch(`${apiUrl}/api/v1/jobs/${jobId}/trigger`, {
    method: 'POST',
    headers: { 'x-helios-client': 'test' },
  });
  assert.equal(trigger.status, 202, await trigger.clone().text());
  const { runId } = (await trigger.json()) as { runId: string };
  await waitFor('the run to end', async () => {
    const { rows } = await db.query<{ state: string }>('SELECT state FROM runs WHERE id = $1', [runId]);
    return rows[0]?.state === 'dead' || rows[0]?.state === 'succeeded' ? rows[0].state : null;
  });
  const refusal = `cluster's own ${job.what}`;
  const attempts = await attemptsOf(db, runId);
  assert.deepEqual(
    attempts.map((a) => [a.outcome, (a.error ?? '').includes(refusal)]),
    [['failed', true]],
    `one attempt, refused before any connection: ${JSON.stringify(attempts.map((a) => a.error))}`,
  );
}
