import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { insertJob, nextWholeSecond, oncePerMinuteAt, stopJobs, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';

// A worker holds back the writes of successes while it has a backlog of calls
// (HELIOS_COMPLETION_HOLD_MS; RunQueue.callsUnderway, execution/batching.ts). On a real node and
// PostgreSQL, with 2 execution slots: a held write still goes once it has waited the hold while a
// long call of the backlog goes on, and the run records when its call ended, not when its write
// went; a long call that got its slot with nothing waiting holds nothing back.

const HOLD_MS = 1000;
let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture({
    // Each call answers at the instant its path names (ms since the epoch), whenever it arrived.
    behaviour: (request) => ({
      status: 200,
      delayMs: Math.max(0, Number(request.path.split('/')[2]) - Date.now()),
    }),
  });
  await fx.start('held-completions-1', {
    HELIOS_COMPLETION_HOLD_MS: String(HOLD_MS),
    HELIOS_WORKER_CONCURRENCY: '2',
  });
});
after(() => fx.teardown());

/** A job due once at `at` whose call is answered at `at` + `answerAfterMs`. */
function job(name: string, at: Date, answerAfterMs: number): Promise<string> {
  return insertJob(fx.db.pool, {
    name: `${name}-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${fx.target.url}/answer/${at.getTime() + answerAfterMs}/${name}` },
    nextRunAt: at,
    timeoutMs: 10_000,
  });
}

/** Once every run of `jobs` succeeded: when the last one's call ended and when it was seen written. */
async function recorded(jobs: string[], at: Date, long: string) {
  return waitFor(
    'the runs to be recorded succeeded',
    async () => {
      const { rows } = await fx.db.pool.query<{ ended: number; written: number; long: string }>(
        `SELECT (extract(epoch FROM max(r.finished_at) - $2::timestamptz) * 1000)::float8 AS ended,
                (extract(epoch FROM clock_timestamp() - $2::timestamptz) * 1000)::float8 AS written,
                (SELECT state FROM runs WHERE job_id = $3) AS long
         FROM runs r WHERE r.job_id = ANY($1::uuid[]) AND r.state = 'succeeded'
         HAVING count(*) = $4`,
        [jobs, at, long, jobs.length],
      );
      return rows[0];
    },
    20_000,
    20,
  );
}

async function untilSucceeded(jobId: string): Promise<void> {
  await waitFor('the long run to succeed', async () => {
    const { rows } = await fx.db.pool.query<{ state: string }>(`SELECT state FROM runs WHERE job_id = $1`, [
      jobId,
    ]);
    return rows[0]?.state === 'succeeded';
  });
}

test(
  'a success held back by a backlog whose long call goes on is written once it has waited the hold, and records when its call ended',
  { timeout: 60_000 },
  async () => {
    const at = await nextWholeSecond(fx.db.pool, 3000);
    const before = new Date(at.getTime() - 1000);
    // Two calls fill both slots from a second before until 50 ms after `at`, so the long call and
    // the fast ones due at `at` all wait for slots: a backlog, the long call among it.
    const fillers = [await job('filler-1', before, 1050), await job('filler-2', before, 1050)];
    const long = await job('long', at, 5000);
    const fast: string[] = [];
    for (let i = 0; i < 5; i++) fast.push(await job(`fast-${i}`, at, 100));
    const seen = await recorded(fast, at, long);
    // Held while the long call was underway, and written once the oldest held (the fillers'
    // successes, from 50 ms after `at`) had waited the hold: before the long call ended.
    assert.ok(seen.written > 100 + HOLD_MS / 2, `written ${Math.round(seen.written)} ms after due: not held`);
    assert.ok(
      seen.written < 100 + HOLD_MS + 1500,
      `written ${Math.round(seen.written)} ms after due: held past HELIOS_COMPLETION_HOLD_MS (${HOLD_MS} ms)`,
    );
    assert.equal(seen.long, 'running', 'the long call was still underway when the fast runs were written');
    assert.ok(
      seen.ended < 100 + 400,
      `finished_at ${Math.round(seen.ended)} ms after due: the write's time, not the call's end (answered at 100 ms)`,
    );
    // Each attempt row agrees, and each run was called once.
    const { rows: attempts } = await fx.db.pool.query<{ ended: number }>(
      `SELECT (extract(epoch FROM a.finished_at - $2::timestamptz) * 1000)::float8 AS ended
       FROM run_attempts a JOIN runs r ON r.id = a.run_id WHERE r.job_id = ANY($1::uuid[])`,
      [fast, at],
    );
    assert.equal(attempts.length, fast.length);
    for (const a of attempts) assert.ok(a.ended < 100 + 400, `attempt finished_at ${a.ended} ms`);
    for (const id of [...fillers, ...fast]) assert.equal(fx.target.forJob(id).length, 1);
    await untilSucceeded(long);
    await stopJobs(fx.db.pool, [...fillers, long, ...fast]);
  },
);

test(
  'a long call that got its slot with nothing waiting holds no success back',
  { timeout: 60_000 },
  async () => {
    const at = await nextWholeSecond(fx.db.pool, 3000);
    // Two runs, two slots: neither waits.
    const long = await job('alone-long', at, 5000);
    const fast = await job('alone-fast', at, 100);
    const seen = await recorded([fast], at, long);
    assert.equal(seen.long, 'running');
    assert.ok(
      seen.written < 100 + HOLD_MS / 2,
      `written ${Math.round(seen.written)} ms after due, its call ended ${Math.round(seen.ended)} ms after due: held back for a call that no backlog made`,
    );
    assert.equal(fx.target.forJob(fast).length, 1);
    await untilSucceeded(long);
    await stopJobs(fx.db.pool, [long, fast]);
  },
);
