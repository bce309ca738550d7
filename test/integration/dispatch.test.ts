import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { scrapeMetrics } from '../support/metrics.js';
import type { ManagedProcess } from '../support/processes.js';

let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture();
});
after(() => fx.teardown());

async function startLeader(name: string): Promise<ManagedProcess> {
  const node = fx.spawn(name, {
    HELIOS_ROLES: 'scheduler,api',
    // A 1 s lookahead and threshold keep the arithmetic of the misfire test simple.
    HELIOS_MISFIRE_THRESHOLD_MS: '1000',
    HELIOS_DISPATCH_LOOKAHEAD_MS: '1000',
  });
  await node.waitForLog((l) => l.msg === 'became leader', 15_000);
  return node;
}

async function insertJob(
  name: string,
  schedule: string,
  fields: { timezone?: string; misfire?: string; maxCatchUp?: number; nextRunAt?: string } = {},
): Promise<string> {
  const { rows } = await fx.db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, timezone, target, misfire, max_catch_up, next_run_at)
     VALUES ($1, $2, $3, '{"url":"http://127.0.0.1:9/"}', $4, $5,
             coalesce($6::timestamptz, date_trunc('second', now()) + interval '1 second'))
     RETURNING id`,
    [
      name,
      schedule,
      fields.timezone ?? 'UTC',
      fields.misfire ?? 'fire-once',
      fields.maxCatchUp ?? 100,
      fields.nextRunAt ?? null,
    ],
  );
  return rows[0]!.id;
}

/**
 * Runs of a job: how many, distinct occurrences, seconds spanned, and how many were created late.
 * `created_at` is the dispatch transaction's now(), the same instant the misfire cutoff
 * (now − 1 s threshold) is computed from, so "late" separates misfired occurrences exactly.
 */
async function runStats(jobId: string) {
  const { rows } = await fx.db.pool.query<{ runs: number; distinct: number; span: number; late: number }>(
    `SELECT count(*)::int AS runs, count(DISTINCT scheduled_for)::int AS distinct,
            coalesce(extract(epoch FROM max(scheduled_for) - min(scheduled_for))::int + 1, 0) AS span,
            count(*) FILTER (WHERE created_at - scheduled_for > interval '1 second')::int AS late
     FROM runs WHERE job_id = $1`,
    [jobId],
  );
  return rows[0]!;
}

test('a 6-field every-second job produces one run per second', async () => {
  const node = await startLeader('every-second');
  const jobId = await insertJob('every-second', '* * * * * *');
  await sleep(5000);
  await node.stop();
  const stats = await runStats(jobId);
  assert.ok(stats.runs >= 4, `only ${stats.runs} runs in 5 s`);
  assert.equal(stats.distinct, stats.runs, 'an occurrence has two runs');
  assert.equal(stats.span, stats.runs, 'a second was skipped');
  assert.equal(stats.late, 0, 'runs were created late');
});

test('misfire policies after a 10 s leaderless gap: fire-all every missed occurrence, fire-once one, skip none', async () => {
  // Jobs are created once a leader runs, so the only late occurrences are those of the gap.
  const first = await startLeader('misfire-1');
  const jobs = {
    all: await insertJob('misfire-all', '* * * * * *', { misfire: 'fire-all', maxCatchUp: 100 }),
    capped: await insertJob('misfire-all-capped', '* * * * * *', { misfire: 'fire-all', maxCatchUp: 3 }),
    once: await insertJob('misfire-once', '* * * * * *', { misfire: 'fire-once' }),
    skip: await insertJob('misfire-skip', '* * * * * *', { misfire: 'skip' }),
  };
  await sleep(2500);
  await first.stop();
  await sleep(10_000); // nobody leads: the cluster is down
  const second = await startLeader('misfire-2');
  await sleep(2500);
  await second.stop();

  const all = await runStats(jobs.all);
  assert.equal(all.distinct, all.runs);
  assert.equal(all.span, all.runs, 'fire-all left a hole');
  assert.ok(all.late >= 7 && all.late <= 12, `fire-all created ${all.late} late runs, expected about 9`);

  const capped = await runStats(jobs.capped);
  assert.equal(capped.late, 3, 'fire-all is bounded by maxCatchUp');

  const once = await runStats(jobs.once);
  assert.equal(once.late, 1, 'fire-once creates exactly one run for the missed occurrences');
  assert.ok(once.span - once.runs >= 6, 'fire-once must not fill the gap');

  const skip = await runStats(jobs.skip);
  assert.equal(skip.late, 0, 'skip creates no run for missed occurrences');
  assert.ok(skip.span - skip.runs >= 7, 'skip must leave the gap empty');
  for (const stats of [capped, once, skip]) assert.equal(stats.distinct, stats.runs);
});

test('02:30 Europe/Berlin fires once on the DST days of 2026 (gap: 03:00 CEST; overlap: first 02:30)', async () => {
  // next_run_at in March: the dispatcher catches up through every day since (fire-all), taking
  // each occurrence from the real cron maths, DST days included.
  const jobId = await insertJob('berlin-0230', '0 30 2 * * *', {
    timezone: 'Europe/Berlin',
    misfire: 'fire-all',
    maxCatchUp: 1000,
    nextRunAt: '2026-03-27T01:30:00Z',
  });
  const node = await startLeader('dst');
  await sleep(1500);
  await node.stop();
  const { rows } = await fx.db.pool.query<{ day: string; at: Date[] }>(
    `SELECT to_char(scheduled_for AT TIME ZONE 'Europe/Berlin', 'YYYY-MM-DD') AS day, array_agg(scheduled_for) AS at
     FROM runs WHERE job_id = $1 GROUP BY 1 ORDER BY 1`,
    [jobId],
  );
  const byDay = new Map(rows.map((r) => [r.day, r.at.map((d) => d.toISOString())]));
  assert.deepEqual(byDay.get('2026-03-28'), ['2026-03-28T01:30:00.000Z']); // 02:30 CET
  assert.deepEqual(byDay.get('2026-03-29'), ['2026-03-29T01:00:00.000Z']); // gap: 03:00 CEST
  assert.deepEqual(byDay.get('2026-03-30'), ['2026-03-30T00:30:00.000Z']); // 02:30 CEST
  assert.deepEqual(byDay.get('2026-10-25'), ['2026-10-25T00:30:00.000Z']); // overlap: the first 02:30
  assert.deepEqual(byDay.get('2026-10-26'), ['2026-10-26T01:30:00.000Z']); // 02:30 CET
  for (const [day, at] of byDay) assert.equal(at.length, 1, `${day} fired ${at.length} times`);
  const first = Date.parse('2026-03-27T00:00:00Z');
  const last = Date.parse(`${rows.at(-1)!.day}T00:00:00Z`);
  assert.equal(rows.length, Math.round((last - first) / 86_400_000) + 1, 'a day without a run');
});

test('1,000 jobs due in the same second are all dispatched in that second', async () => {
  const node = await startLeader('herd');
  const { rows } = await fx.db.pool.query<{ due: Date }>(
    `SELECT date_trunc('second', now()) + interval '3 seconds' AS due`,
  );
  const due = rows[0]!.due;
  await fx.db.pool.query(
    `INSERT INTO jobs (name, schedule, target, next_run_at)
     SELECT 'herd-' || i, $1, '{"url":"http://127.0.0.1:9/"}', $2 FROM generate_series(1, 1000) AS i`,
    [`${due.getUTCSeconds()} * * * * *`, due],
  );
  await sleep(due.getTime() - Date.now() + 1000);
  const counts = await fx.db.pool.query<{ runs: number; in_time: number; published: number }>(
    `SELECT count(*)::int AS runs,
            count(*) FILTER (WHERE r.created_at < r.scheduled_for + interval '1 second')::int AS in_time,
            count(o.published_at)::int AS published
     FROM runs r JOIN jobs j ON j.id = r.job_id
     LEFT JOIN outbox o ON o.payload->>'runId' = r.id::text
     WHERE j.name LIKE 'herd-%' AND r.scheduled_for = $1`,
    [due],
  );
  await node.stop();
  assert.equal(counts.rows[0]!.runs, 1000);
  assert.equal(counts.rows[0]!.in_time, 1000, 'some runs were created after their second had passed');
  assert.equal(counts.rows[0]!.published, 1000, 'some runs were not published to Kafka');
});

test('a schedule that cannot be evaluated parks its job, with the reason in the API and a metric', async () => {
  const node = await startLeader('parking');
  // Stored behind the API's back (an older version, a zone that disappeared): the API refuses it.
  const broken = await insertJob('parked-job', '61 * * * * *');
  const healthy = await insertJob('unparked-job', '* * * * * *');
  const started = await node.waitForLog((l) => l.msg === 'node started');
  const api = started.apiUrl as string;
  await waitFor('the job to be parked', async () => {
    const job = (await (await fetch(`${api}/api/v1/jobs/${broken}`)).json()) as Record<string, unknown>;
    return job.scheduleError ? job : null;
  });
  const job = (await (await fetch(`${api}/api/v1/jobs/${broken}`)).json()) as Record<string, unknown>;
  assert.equal(job.nextRunAt, null);
  assert.match(String(job.scheduleError), /\S/);
  const metrics = await (await fetch(`${api}/metrics`)).text();
  assert.match(metrics, /^helios_jobs_parked_total(\{[^}]*\})? 1$/m);
  assert.ok((await runStats(healthy)).runs >= 1, 'the other job kept running');
  // An edit that gives it a valid schedule unparks it.
  const edited = await fetch(`${api}/api/v1/jobs/${broken}`, {
    method: 'PATCH',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ schedule: '* * * * * *' }),
  });
  const after = (await edited.json()) as Record<string, unknown>;
  assert.equal(edited.status, 200, JSON.stringify(after));
  assert.equal(after.scheduleError, null);
  assert.notEqual(after.nextRunAt, null);
  await node.stop();
});

test(
  'a catch-up of 60,000 occurrences goes in passes of about 5,000 runs; the leader keeps its lease, and a job due meanwhile gets its runs ahead of time',
  { timeout: 120_000 },
  async () => {
    // 60 jobs firing on the second Friday of each month in New York, each 1,000 missed occurrences
    // to fire (fire-all), each with its own next_run_at so that no two share a plan. With the
    // forward catch-up walk (≈110 µs an occurrence here, ≈6.5 s for all of them, twice the lease's
    // TTL) one pass planned them all without a turn of the event loop: the leader's keep-alives
    // waited, its lease ran out before the pass committed, the fence refused the pass, and every
    // next leader met the same pass (0 runs in 60 s). The backward walk costs ≈37 µs an occurrence.
    await fx.db.pool.query('UPDATE jobs SET enabled = false');
    const jobs = 60;
    const { rows } = await fx.db.pool.query<{ id: string }>(
      `INSERT INTO jobs (name, schedule, timezone, target, misfire, max_catch_up, next_run_at)
       SELECT 'catch-up-' || i, '0 0 * * 5#2', 'America/New_York', '{"url":"http://127.0.0.1:9/"}', 'fire-all', 1000,
              timestamptz '1900-01-01 05:00:00Z' + i * interval '1 millisecond'
       FROM generate_series(1, $1) AS i
       RETURNING id`,
      [jobs],
    );
    const ids = rows.map((r) => r.id);
    // Due from 2 s on, every second, while the catch-up goes: its runs must be created ahead of
    // their time, as the lookahead promises (passes ordered by next_run_at alone kept it behind
    // every pass of the catch-up: late, then a misfire).
    const everySecond = await insertJob('during-catch-up', '* * * * * *', {
      nextRunAt: new Date(Date.now() + 2000).toISOString(),
    });
    // The default lookahead and misfire threshold (5 s).
    const node = fx.spawn('catch-up', { HELIOS_ROLES: 'scheduler' });
    await node.waitForLog((l) => l.msg === 'became leader', 15_000);
    const counts = async () =>
      (
        await fx.db.pool.query<{ runs: number; late: number; pending: number }>(
          `SELECT (SELECT count(*)::int FROM runs WHERE job_id = ANY($1::uuid[])) AS runs,
                  (SELECT count(*)::int FROM runs WHERE job_id = ANY($1::uuid[])
                     AND created_at - scheduled_for > interval '5 seconds') AS late,
                  (SELECT count(*)::int FROM jobs WHERE id = ANY($1::uuid[]) AND next_run_at < now()) AS pending`,
          [ids],
        )
      ).rows[0]!;
    await waitFor('every job to be caught up', async () => (await counts()).pending === 0, 60_000).catch(
      async (err: unknown) => {
        const steps = node.logs.filter((l) => l.msg === 'stepped down').map((l) => String(l.reason));
        throw new Error(`${String(err)}: ${JSON.stringify(await counts())}, step-downs: ${steps.join(', ')}`);
      },
    );
    await node.stop();
    const { runs, late } = await counts();
    assert.equal(late, jobs * 1000, 'each job fires its 1,000 latest missed occurrences');
    assert.ok(runs - late <= jobs, `${runs - late} on-time runs: at most one midnight each`);
    const { rows: passes } = await fx.db.pool.query<{ runs: number }>(
      `SELECT count(*)::int AS runs FROM runs WHERE job_id = ANY($1::uuid[]) GROUP BY created_at`,
      [ids],
    );
    // created_at is the dispatch transaction's now(): one group per pass.
    assert.ok(passes.length >= 12, `${passes.length} passes`);
    const largest = Math.max(...passes.map((p) => p.runs));
    assert.ok(largest <= 5000 + 1001, `a pass created ${largest} runs`);
    assert.deepEqual(
      node.logs.filter((l) => l.msg === 'became leader' || l.msg === 'stepped down').map((l) => l.msg),
      ['became leader', 'stepped down'],
      'one epoch, ended by the stop',
    );
    assert.equal(node.logs.find((l) => l.msg === 'stepped down')?.reason, 'shutdown');

    const { rows: during } = await fx.db.pool.query<{ at: Date; lagMs: number }>(
      `SELECT scheduled_for AS at, extract(epoch FROM created_at - scheduled_for) * 1000 AS "lagMs"
       FROM runs WHERE job_id = $1 ORDER BY scheduled_for`,
      [everySecond],
    );
    const stats = await runStats(everySecond);
    assert.ok(stats.runs >= 5, `${stats.runs} runs of the job due during the catch-up`);
    assert.equal(stats.span, stats.runs, 'the job due during the catch-up lost a second');
    const behind = during.filter((r) => r.lagMs > 0);
    assert.deepEqual(behind, [], 'runs of the job due during the catch-up created after their time');
  },
);

test('catch-ups of jobs with 64 KiB targets go one job a pass, each whole, and each misfire counts once', async () => {
  await fx.db.pool.query('UPDATE jobs SET enabled = false');
  // Every run copies its job's target: 300 runs of one of these are ≈19 MB, more than a pass's
  // 16 MiB, so each job goes alone, whole (its statements cut to 16 MiB). In one statement, a
  // larger target or catch-up outlasted the 30 s statement timeout on every try.
  const { rows } = await fx.db.pool.query<{ id: string; bytes: number }>(
    `INSERT INTO jobs (name, schedule, timezone, target, misfire, max_catch_up, next_run_at)
     SELECT 'large-target-' || i, '0 * * * *', 'UTC',
            jsonb_build_object('url', 'http://127.0.0.1:9/', 'method', 'POST',
                               'body', (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 2048))),
            'fire-all', 300, timestamptz '2020-01-01 00:00:00Z' + i * interval '1 millisecond'
     FROM generate_series(1, 4) AS i
     RETURNING id, pg_column_size(target) AS bytes`,
  );
  const ids = rows.map((r) => r.id);
  assert.ok(
    rows.every((r) => r.bytes > 60_000),
    `targets of ${rows.map((r) => r.bytes).join(', ')} bytes: compressed`,
  );
  const node = await startLeader('large-target');
  const started = await node.waitForLog((l) => l.msg === 'node started');
  await waitFor(
    'the catch-up',
    async () =>
      (
        await fx.db.pool.query(
          'SELECT 1 FROM jobs WHERE id = ANY($1::uuid[]) AND next_run_at < now() HAVING count(*) = 0',
          [ids],
        )
      ).rowCount,
    60_000,
  );
  const metrics = await scrapeMetrics(started.apiUrl as string);
  await node.stop();
  const { rows: jobs } = await fx.db.pool.query<{ runs: number; distinct: number; passes: number }>(
    `SELECT count(*)::int AS runs, count(DISTINCT scheduled_for)::int AS distinct,
            count(DISTINCT created_at)::int AS passes
     FROM runs WHERE job_id = ANY($1::uuid[]) GROUP BY job_id`,
    [ids],
  );
  assert.deepEqual(
    jobs,
    ids.map(() => ({ runs: 300, distinct: 300, passes: 1 })),
    'each job: its 300 latest missed occurrences, once, in one pass',
  );
  const { rows: passes } = await fx.db.pool.query<{ jobs: number }>(
    `SELECT count(DISTINCT job_id)::int AS jobs FROM runs WHERE job_id = ANY($1::uuid[]) GROUP BY created_at`,
    [ids],
  );
  assert.deepEqual(
    passes.map((p) => p.jobs),
    [1, 1, 1, 1],
    'one job a pass: two are more than 16 MiB',
  );
  assert.equal(
    metrics.value('helios_misfires_total', { policy: 'fire-all' }),
    4,
    'each misfire counted once',
  );
});
