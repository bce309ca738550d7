import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { inTransaction } from '../../src/store/db.js';
import { buryRun } from '../../src/store/dead-letters.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';

let api: TestApi;
before(async () => {
  api = await startTestApi();
});
after(() => api.close());

interface DeadLetter {
  id: string;
  runId: string;
  jobId: string;
  jobName: string;
  attempt: number;
  error: string | null;
  statusCode: number | null;
  replayedAt: string | null;
  replayCount: number;
}

/** A job whose run used up its 3 attempts, dead-lettered the way the worker does it. */
async function deadRun(name: string): Promise<{ jobId: string; runId: string; letterId: string }> {
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody(name) })).body as { id: string };
  return inTransaction(api.db.pool, async (client) => {
    const { rows } = await client.query<{ id: string; scheduledFor: Date }>(
      `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms,
                         backoff_ms, backoff_multiplier, not_before, finished_at)
       SELECT id, now() - interval '1 minute', 'dead', 3, 3, target, timeout_ms, backoff_ms,
              backoff_multiplier, now() - interval '1 minute', now()
       FROM jobs WHERE id = $1
       RETURNING id, scheduled_for AS "scheduledFor"`,
      [job.id],
    );
    const run = rows[0]!;
    const letterId = await buryRun(
      client,
      { id: run.id, jobId: job.id, attempt: 3, scheduledFor: run.scheduledFor },
      { error: 'HTTP 503', statusCode: 503 },
      { deadLetterTopic: `${api.runsTopic}.dlq` },
    );
    return { jobId: job.id, runId: run.id, letterId };
  });
}

test('dead letters are listed newest first with their job name, paginated', async () => {
  const first = await deadRun('dl-first');
  const second = await deadRun('dl-second');
  const page1 = await api.call('GET', '/api/v1/dead-letters?limit=1');
  assert.equal(page1.status, 200);
  const body1 = page1.body as { items: DeadLetter[]; nextCursor: string };
  assert.equal(body1.items[0]!.id, second.letterId);
  assert.equal(body1.items[0]!.jobName, 'dl-second');
  assert.equal(body1.items[0]!.statusCode, 503);
  assert.equal(body1.items[0]!.attempt, 3);
  const page2 = await api.call('GET', `/api/v1/dead-letters?limit=1&cursor=${body1.nextCursor}`);
  const body2 = page2.body as { items: DeadLetter[]; nextCursor: string | null };
  assert.equal(body2.items[0]!.id, first.letterId);
  assert.equal((await api.call('GET', '/api/v1/dead-letters?cursor=xyz')).status, 400);
  assert.equal((await api.call('GET', '/api/v1/dead-letters?open=perhaps')).status, 400);
});

test('replay re-queues the dead run as a new attempt with its message, once', async () => {
  const { runId, letterId, jobId } = await deadRun('dl-replay');
  const response = await api.call('POST', `/api/v1/dead-letters/${letterId}/replay`);
  assert.equal(response.status, 202, JSON.stringify(response.body));
  assert.deepEqual(response.body, { runId });
  const run = await api.db.pool.query('SELECT state, attempt, max_attempts FROM runs WHERE id = $1', [runId]);
  assert.deepEqual(run.rows[0], { state: 'queued', attempt: 3, max_attempts: 6 });
  const outbox = await api.db.pool.query(
    `SELECT payload FROM outbox WHERE topic = $1 AND payload->>'runId' = $2`,
    [api.runsTopic, runId],
  );
  assert.equal(outbox.rows.length, 1);
  assert.equal(outbox.rows[0].payload.attempt, 4);
  assert.equal(outbox.rows[0].payload.jobId, jobId);

  const open = await api.call('GET', '/api/v1/dead-letters?open=true');
  assert.ok(!(open.body as { items: DeadLetter[] }).items.some((d) => d.id === letterId));
  const all = await api.call('GET', '/api/v1/dead-letters');
  const replayed = (all.body as { items: DeadLetter[] }).items.find((d) => d.id === letterId)!;
  assert.ok(replayed.replayedAt);
  assert.equal(replayed.replayCount, 1);

  const again = await api.call('POST', `/api/v1/dead-letters/${letterId}/replay`);
  assert.equal(again.status, 409);
  assert.match(again.headers.get('content-type') ?? '', /problem\+json/);
});

test('a replay calls the job as it is now: fix the target, then replay', async () => {
  const { runId, letterId, jobId } = await deadRun('dl-fixed');
  const fixed = `http://127.0.0.1:9/fixed`;
  const patch = await api.call('PATCH', `/api/v1/jobs/${jobId}`, {
    body: {
      target: { url: fixed, method: 'PUT' },
      timeoutMs: 7000,
      retry: { maxAttempts: 2, backoffMs: 10 },
    },
  });
  assert.equal(patch.status, 200, JSON.stringify(patch.body));
  assert.equal((await api.call('POST', `/api/v1/dead-letters/${letterId}/replay`)).status, 202);
  const { rows } = await api.db.pool.query(
    'SELECT target, timeout_ms, backoff_ms, max_attempts FROM runs WHERE id = $1',
    [runId],
  );
  assert.deepEqual(rows[0], {
    target: { url: fixed, method: 'PUT', headers: {} },
    timeout_ms: 7000,
    backoff_ms: 10,
    max_attempts: 5,
  });
  const outbox = await api.db.pool.query(
    `SELECT payload FROM outbox WHERE topic = $1 AND payload->>'runId' = $2`,
    [api.runsTopic, runId],
  );
  assert.equal(outbox.rows[0].payload.timeoutMs, 7000, 'announced with the timeout it now has');
});

test('replaying an unknown or malformed dead letter id is a 404 problem', async () => {
  const unknown = await api.call('POST', '/api/v1/dead-letters/00000000-0000-4000-8000-000000000000/replay');
  assert.equal(unknown.status, 404);
  assert.match(unknown.headers.get('content-type') ?? '', /problem\+json/);
  assert.equal((await api.call('POST', '/api/v1/dead-letters/zzz/replay')).status, 404);
});
