import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { insertJob, nextWholeSecond, oncePerMinuteAt, stopJobs, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';

// A worker holds back the writes of successes while its other calls are underway
// (HELIOS_COMPLETION_HOLD_MS, execution/batching.ts). On a real node and PostgreSQL: a held write
// still goes once it has waited the hold, while a long call goes on, and the run records when its
// call ended, not when its write went.

const HOLD_MS = 1000;
const FAST_ANSWER_MS = 100;
const LONG_ANSWER_MS = 5000;
let dueAt = 0;
let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture({
    // Each call answers at a fixed instant after the occurrence, whenever it arrived.
    behaviour: (request) => ({
      status: 200,
      delayMs: Math.max(
        0,
        dueAt + (request.path.startsWith('/long') ? LONG_ANSWER_MS : FAST_ANSWER_MS) - Date.now(),
      ),
    }),
  });
  await fx.start('held-completions-1', { HELIOS_COMPLETION_HOLD_MS: String(HOLD_MS) });
});
after(() => fx.teardown());

test(
  'a success held back while a long call goes on is written once it has waited the hold, and records when its call ended',
  { timeout: 60_000 },
  async () => {
    const at = await nextWholeSecond(fx.db.pool, 2000);
    dueAt = at.getTime();
    const job = (name: string) =>
      insertJob(fx.db.pool, {
        name: `${name}-${uniqueId()}`,
        schedule: oncePerMinuteAt(at),
        target: { url: `${fx.target.url}/${name}` },
        nextRunAt: at,
        timeoutMs: 10_000,
      });
    const long = await job('long');
    const fast: string[] = [];
    for (let i = 0; i < 5; i++) fast.push(await job(`fast-${i}`));
    const recorded = await waitFor(
      'the fast runs to be recorded succeeded',
      async () => {
        const { rows } = await fx.db.pool.query<{ ended: number; written: number; long: string }>(
          `SELECT (extract(epoch FROM max(r.finished_at) - $2::timestamptz) * 1000)::float8 AS ended,
                  (extract(epoch FROM clock_timestamp() - $2::timestamptz) * 1000)::float8 AS written,
                  (SELECT state FROM runs WHERE job_id = $3) AS long
           FROM runs r WHERE r.job_id = ANY($1::uuid[]) AND r.state = 'succeeded'
           HAVING count(*) = $4`,
          [fast, at, long, fast.length],
        );
        return rows[0];
      },
      20_000,
      20,
    );
    // Held while the long call was underway, and written once they had waited the hold: before it
    // ended.
    assert.ok(
      recorded.written > FAST_ANSWER_MS + HOLD_MS / 2,
      `written ${Math.round(recorded.written)} ms after due: not held back at all`,
    );
    assert.equal(
      recorded.long,
      'running',
      'the long call was still underway when the fast runs were written',
    );
    assert.ok(
      recorded.written < FAST_ANSWER_MS + HOLD_MS + 1500,
      `written ${Math.round(recorded.written)} ms after due: held past HELIOS_COMPLETION_HOLD_MS (${HOLD_MS} ms)`,
    );
    assert.ok(
      recorded.ended < FAST_ANSWER_MS + 400,
      `finished_at ${Math.round(recorded.ended)} ms after due: the write's time, not the call's end (answered at ${FAST_ANSWER_MS} ms)`,
    );
    // Each attempt row agrees, and each run was called once.
    const { rows: attempts } = await fx.db.pool.query<{ ended: number }>(
      `SELECT (extract(epoch FROM a.finished_at - $2::timestamptz) * 1000)::float8 AS ended
       FROM run_attempts a JOIN runs r ON r.id = a.run_id WHERE r.job_id = ANY($1::uuid[])`,
      [fast, at],
    );
    assert.equal(attempts.length, fast.length);
    for (const a of attempts) assert.ok(a.ended < FAST_ANSWER_MS + 400, `attempt finished_at ${a.ended} ms`);
    for (const id of fast) assert.equal(fx.target.forJob(id).length, 1);
    await waitFor('the long run to succeed', async () => {
      const { rows } = await fx.db.pool.query<{ state: string }>(`SELECT state FROM runs WHERE job_id = $1`, [
        long,
      ]);
      return rows[0]?.state === 'succeeded';
    });
    await stopJobs(fx.db.pool, [long, ...fast]);
  },
);
