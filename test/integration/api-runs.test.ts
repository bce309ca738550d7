import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { createRuns } from '../../src/store/dispatch.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';

let api: TestApi;
before(async () => {
  api = await startTestApi();
});
after(() => api.close());

interface Job {
  id: string;
  enabled: boolean;
  nextRunAt: string | null;
}
interface Run {
  id: string;
  state: string;
  trigger: string;
  scheduledFor: string;
  reason: string | null;
}

async function createJob(name: string, overrides: Record<string, unknown> = {}): Promise<Job> {
  const response = await api.call('POST', '/api/v1/jobs', { body: jobBody(name, overrides) });
  assert.equal(response.status, 201, JSON.stringify(response.body));
  return response.body as Job;
}

/** Inserts a run as the dispatcher would, `offsetMs` from the database's now(). */
async function insertRun(jobId: string, offsetMs: number, state = 'queued', attempt = 0): Promise<string> {
  const { rows } = await api.db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms,
                       backoff_ms, backoff_multiplier, not_before)
     SELECT id, now() + $2 * interval '1 millisecond', $3, $4, max_attempts, target, timeout_ms,
            backoff_ms, backoff_multiplier, now() + $2 * interval '1 millisecond'
     FROM jobs WHERE id = $1 RETURNING id`,
    [jobId, offsetMs, state, attempt],
  );
  return rows[0]!.id;
}

async function runState(id: string): Promise<{ state: string; reason: string | null }> {
  const { rows } = await api.db.pool.query('SELECT state, reason FROM runs WHERE id = $1', [id]);
  return rows[0];
}

test('trigger creates a manual queued run for now() and the same dispatch message the dispatcher writes', async () => {
  const job = await createJob('trigger-me');
  const response = await api.call('POST', `/api/v1/jobs/${job.id}/trigger`);
  assert.equal(response.status, 202);
  const { runId } = response.body as { runId: string };
  const { rows } = await api.db.pool.query(
    `SELECT r.trigger, r.state, r.attempt, r.created_epoch, r.scheduled_for, r.not_before, r.target,
            r.max_attempts, o.topic, o.key, o.payload
     FROM runs r JOIN outbox o ON o.payload->>'runId' = r.id::text WHERE r.id = $1`,
    [runId],
  );
  assert.equal(rows.length, 1, 'exactly one outbox row for the run');
  const row = rows[0];
  assert.equal(row.trigger, 'manual');
  assert.equal(row.state, 'queued');
  assert.equal(row.attempt, 0);
  assert.equal(row.created_epoch, null);
  assert.equal(row.max_attempts, 3);
  assert.deepEqual(row.target, {
    url: 'http://127.0.0.1:9/hook',
    method: 'POST',
    headers: {},
    body: { hello: 'world' },
  });
  assert.equal(row.topic, api.runsTopic);
  assert.equal(row.key, job.id);

  // The dispatcher's message for a scheduled run of another job: same keys, same value shapes.
  const other = await createJob('dispatched');
  await createRuns(
    api.db.pool,
    [{ jobId: other.id, scheduledFor: new Date(Date.now() + 60_000) }],
    1n,
    api.runsTopic,
  );
  const dispatched = await api.db.pool.query(`SELECT payload FROM outbox WHERE key = $1`, [other.id]);
  const manual = row.payload as Record<string, unknown>;
  const scheduled = dispatched.rows[0].payload as Record<string, unknown>;
  assert.deepEqual(Object.keys(manual).sort(), Object.keys(scheduled).sort());
  for (const key of Object.keys(scheduled)) assert.equal(typeof manual[key], typeof scheduled[key], key);
  assert.equal(manual.attempt, 1);
  assert.equal(manual.runId, runId);
  assert.equal(new Date(manual.scheduledFor as string).getTime(), (row.scheduled_for as Date).getTime());
});

test('trigger errors: unknown job 404', async () => {
  const missing = await api.call('POST', '/api/v1/jobs/00000000-0000-4000-8000-00000000abcd/trigger');
  assert.equal(missing.status, 404);
  assert.match(missing.headers.get('content-type') ?? '', /problem\+json/);
});

async function runExists(id: string): Promise<boolean> {
  const { rowCount } = await api.db.pool.query('SELECT 1 FROM runs WHERE id = $1', [id]);
  return rowCount === 1;
}

test('pause disables the job and withdraws its runs created ahead of time; running and due runs are kept', async () => {
  const job = await createJob('pause-me');
  const ahead = await insertRun(job.id, 800);
  const due = await insertRun(job.id, -5000);
  const running = await insertRun(job.id, -10_000, 'running', 1);
  const response = await api.call('POST', `/api/v1/jobs/${job.id}/pause`);
  assert.equal(response.status, 200);
  assert.equal((response.body as Job).enabled, false);
  // Withdrawn, not marked skipped: a resume creates the same instants again if they are still ahead.
  assert.equal(await runExists(ahead), false);
  assert.equal((await runState(due)).state, 'queued');
  assert.equal((await runState(running)).state, 'running');
  // Pausing again changes nothing and still answers with the job.
  const again = await api.call('POST', `/api/v1/jobs/pause-me/pause`);
  assert.equal(again.status, 200);
  assert.equal((again.body as Job).enabled, false);
  // A paused job can still be run by hand.
  assert.equal((await api.call('POST', `/api/v1/jobs/${job.id}/trigger`)).status, 202);
});

test('resume enables the job with nextRunAt after the database now, so missed occurrences do not fire', async () => {
  const job = await createJob('resume-me', { schedule: '* * * * * *' });
  await api.call('POST', `/api/v1/jobs/${job.id}/pause`);
  await api.db.pool.query(`UPDATE jobs SET next_run_at = now() - interval '1 day' WHERE id = $1`, [job.id]);
  const response = await api.call('POST', `/api/v1/jobs/${job.id}/resume`);
  assert.equal(response.status, 200);
  const resumed = response.body as Job;
  assert.equal(resumed.enabled, true);
  const { rows } = await api.db.pool.query<{ now: Date }>('SELECT now() AS now');
  const next = new Date(resumed.nextRunAt!).getTime();
  assert.ok(
    next > rows[0]!.now.getTime() - 1000 && next <= rows[0]!.now.getTime() + 1000,
    resumed.nextRunAt!,
  );
  assert.equal((await api.call('POST', `/api/v1/jobs/${job.id}/resume`)).status, 200, 'idempotent');
  assert.equal((await api.call('POST', '/api/v1/jobs/nobody/resume')).status, 404);
  assert.equal((await api.call('POST', '/api/v1/jobs/nobody/pause')).status, 404);
});

test('PATCH enabled=false behaves like pause', async () => {
  const job = await createJob('patch-pause');
  const ahead = await insertRun(job.id, 900);
  const response = await api.call('PATCH', `/api/v1/jobs/${job.id}`, { body: { enabled: false } });
  assert.equal(response.status, 200);
  assert.equal(await runExists(ahead), false);
});

test('PATCH of what runs copy withdraws the runs created ahead, so they are created again from the edit', async () => {
  // Yearly: the schedule's own next occurrence never comes before the withdrawn runs (every minute,
  // it did when the test ran in the 2.5 s before a whole minute).
  const job = await createJob('patch-target', { schedule: '0 0 1 1 *' });
  const ahead = [await insertRun(job.id, 2500), await insertRun(job.id, 1500)];
  const due = await insertRun(job.id, -5000);
  // Claimed ahead by a worker: one whose call has begun (marked started), one whose has not.
  const started = await insertRun(job.id, 1000, 'running', 1);
  await api.db.pool.query('UPDATE runs SET started_at = now() WHERE id = $1', [started]);
  const claimedAhead = await insertRun(job.id, 2000, 'running', 1);
  const before = await api.db.pool.query<{ earliest: Date }>(
    'SELECT scheduled_for AS earliest FROM runs WHERE id = $1',
    [ahead[1]],
  );
  const response = await api.call('PATCH', `/api/v1/jobs/${job.id}`, {
    body: { target: { url: 'http://127.0.0.1:9/changed' } },
  });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  assert.deepEqual(await Promise.all(ahead.map(runExists)), [false, false], 'runs ahead withdrawn');
  assert.equal((await runState(due)).state, 'queued', 'a due run is not withdrawn');
  assert.equal((await runState(started)).state, 'running', 'a run whose call has begun is not withdrawn');
  assert.equal(await runExists(claimedAhead), false, 'a run claimed ahead and not started is withdrawn');
  // The dispatcher creates the withdrawn occurrences again, with the new target.
  assert.equal(new Date((response.body as Job).nextRunAt!).getTime(), before.rows[0]!.earliest.getTime());
});

test('PATCH of the schedule withdraws the runs created ahead and plans the new schedule', async () => {
  const job = await createJob('patch-schedule');
  const ahead = await insertRun(job.id, 1500);
  const response = await api.call('PATCH', `/api/v1/jobs/${job.id}`, { body: { schedule: '0 0 1 1 *' } });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  assert.equal(await runExists(ahead), false);
  assert.equal(new Date((response.body as Job).nextRunAt!).getUTCMonth(), 0);
});

test('PATCH of what runs do not withdraw for (name, misfire) leaves the runs created ahead alone', async () => {
  const job = await createJob('patch-name');
  const ahead = await insertRun(job.id, 1500);
  const response = await api.call('PATCH', `/api/v1/jobs/${job.id}`, {
    body: { name: 'patch-name-2', misfire: 'skip' },
  });
  assert.equal(response.status, 200, JSON.stringify(response.body));
  assert.equal((await runState(ahead)).state, 'queued');
  assert.equal((response.body as Job).nextRunAt, job.nextRunAt);
});

test('run history is newest first, paginated, filterable by state', async () => {
  const job = await createJob('history');
  const ids: string[] = [];
  for (let i = 0; i < 7; i++)
    ids.push(await insertRun(job.id, -i * 60_000, i % 2 === 0 ? 'succeeded' : 'failed'));
  const seen: Run[] = [];
  let cursor: string | null = null;
  do {
    const query: string = `?limit=3${cursor ? `&cursor=${cursor}` : ''}`;
    const response = await api.call('GET', `/api/v1/jobs/${job.id}/runs${query}`);
    assert.equal(response.status, 200);
    const page = response.body as { items: Run[]; nextCursor: string | null };
    seen.push(...page.items);
    cursor = page.nextCursor;
  } while (cursor);
  assert.deepEqual(
    seen.map((r) => r.id),
    ids,
    'newest occurrence first, each once',
  );
  const failed = await api.call('GET', `/api/v1/jobs/history/runs?state=failed`);
  assert.deepEqual(
    (failed.body as { items: Run[] }).items.map((r) => r.state),
    ['failed', 'failed', 'failed'],
  );
  assert.equal((await api.call('GET', `/api/v1/jobs/history/runs?state=lost`)).status, 400);
  assert.equal((await api.call('GET', `/api/v1/jobs/history/runs?cursor=%%%`)).status, 400);
  assert.equal((await api.call('GET', `/api/v1/jobs/nobody/runs`)).status, 404);
});

test('one run is shown with its attempts; unknown or malformed run ids are 404', async () => {
  const job = await createJob('detail', {
    target: { url: 'http://127.0.0.1:9/', headers: { Authorization: 'Bearer run-secret' } },
  });
  const runId = await insertRun(job.id, -1000, 'failed', 2);
  await api.db.pool.query(
    `INSERT INTO run_attempts (run_id, attempt, node_id, finished_at, outcome, status_code, duration_ms, error)
     VALUES ($1, 1, 'n1', now(), 'failed', 500, 12, 'HTTP 500'), ($1, 2, 'n2', now(), 'timeout', NULL, 30000, 'timed out')`,
    [runId],
  );
  const response = await api.call('GET', `/api/v1/runs/${runId}`);
  assert.equal(response.status, 200);
  const run = response.body as {
    attempts: { attempt: number; nodeId: string; outcome: string }[];
    target: { headers: object };
  };
  assert.deepEqual(
    run.attempts.map((a) => [a.attempt, a.nodeId, a.outcome]),
    [
      [1, 'n1', 'failed'],
      [2, 'n2', 'timeout'],
    ],
  );
  assert.deepEqual(run.target.headers, { Authorization: '***' });
  assert.equal((await api.call('GET', '/api/v1/runs/00000000-0000-4000-8000-000000000000')).status, 404);
  assert.equal((await api.call('GET', '/api/v1/runs/not-a-uuid')).status, 404);
});
