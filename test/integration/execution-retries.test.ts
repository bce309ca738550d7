import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import type { DeadLetterMessage } from '../../src/store/dead-letters.js';
import { uniqueId } from '../support/env.js';
import {
  attemptsOf,
  insertJob,
  nextWholeSecond,
  oncePerMinuteAt,
  runsOf,
  stopJobs,
  waitFor,
  type Behaviour,
  type JobSpec,
} from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { TopicRecorder } from '../support/kafka.js';

let fx: IntegrationFixture;
let dlq: TopicRecorder;

// The target's behaviour is chosen by the path of each job's URL.
const behaviour: Behaviour = (request, nth) => {
  switch (request.path) {
    case '/flaky':
      return { status: nth <= 2 ? 500 : 200, body: nth <= 2 ? 'not yet' : 'done' };
    case '/broken':
      return { status: 500, body: 'still broken' };
    case '/silent':
      return { hang: true };
    case '/poison':
      return { status: 503, delayMs: 300 };
    default:
      return { status: 200 };
  }
};

before(async () => {
  fx = await integrationFixture({ behaviour });
  // One partition: the poison job's messages and the healthy job's share it.
  await fx.start('retry-1', { HELIOS_KAFKA_PARTITIONS: '1' });
  dlq = new TopicRecorder(`${fx.topic}.dlq`);
  await dlq.start();
});
after(async () => {
  await dlq?.stop();
  await fx.teardown();
});

/** A job that fires once, at a whole second about two seconds from now. */
async function oneShot(path: string, spec: Partial<JobSpec>): Promise<{ jobId: string; at: Date }> {
  const at = await nextWholeSecond(fx.db.pool, 1500);
  const jobId = await insertJob(fx.db.pool, {
    name: `${path.slice(1)}-${uniqueId()}`,
    schedule: oncePerMinuteAt(at),
    target: { url: `${fx.target.url}${path}` },
    nextRunAt: at,
    ...spec,
  });
  return { jobId, at };
}

/** The job's only run, once it is dead (waits up to 15 s). */
async function deadRunOf(jobId: string) {
  const [run] = await waitFor(
    'the run to be dead',
    async () => {
      const runs = await runsOf(fx.db.pool, jobId);
      return runs[0]?.state === 'dead' ? runs : null;
    },
    15_000,
  );
  return run!;
}

test(
  '500 twice then 200: three attempts, backoff respected, final succeeded',
  { timeout: 30_000 },
  async () => {
    const { jobId } = await oneShot('/flaky', { maxAttempts: 3, backoffMs: 1000, backoffMultiplier: 2 });
    const [run] = await waitFor(
      'the run to succeed',
      async () => {
        const runs = await runsOf(fx.db.pool, jobId);
        return runs[0]?.state === 'succeeded' ? runs : null;
      },
      20_000,
    );
    const calls = fx.target.forJob(jobId);
    assert.deepEqual(
      calls.map((c) => [c.attempt, c.idempotencyKey]),
      [
        [1, run!.id],
        [2, run!.id],
        [3, run!.id],
      ],
    );
    // backoff 1000 ms then 2000 ms; jitter only adds (≤ 20 %), delivery adds a little more.
    const gaps = [calls[1]!.arrivedAt - calls[0]!.arrivedAt, calls[2]!.arrivedAt - calls[1]!.arrivedAt];
    assert.ok(gaps[0]! >= 1000 && gaps[0]! < 1000 * 1.2 + 500, `first gap ${gaps[0]} ms`);
    assert.ok(gaps[1]! >= 2000 && gaps[1]! < 2000 * 1.2 + 500, `second gap ${gaps[1]} ms`);
    const attempts = await attemptsOf(fx.db.pool, run!.id);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.outcome, a.statusCode, a.responseExcerpt]),
      [
        [1, 'failed', 500, 'not yet'],
        [2, 'failed', 500, 'not yet'],
        [3, 'succeeded', 200, 'done'],
      ],
    );
    assert.equal(run!.attempt, 3);
  },
);

test(
  'always 500: the run is dead, with a dead_letters row and a DLQ message',
  { timeout: 30_000 },
  async () => {
    const { jobId } = await oneShot('/broken', { maxAttempts: 2, backoffMs: 200 });
    const run = await deadRunOf(jobId);
    assert.equal(fx.target.forJob(jobId).length, 2);
    const { rows } = await fx.db.pool.query<{
      id: string;
      attempt: number;
      statusCode: number;
      error: string;
    }>(`SELECT id, attempt, status_code AS "statusCode", error FROM dead_letters WHERE run_id = $1`, [
      run.id,
    ]);
    assert.deepEqual(
      rows.map((r) => [r.attempt, r.statusCode, r.error]),
      [[2, 500, 'HTTP 500']],
    );
    const message = await waitFor(
      'the dead-letter message',
      () => dlq.payloads<DeadLetterMessage>().find((m) => m.runId === run.id),
      15_000,
    );
    assert.equal(message.deadLetterId, rows[0]!.id);
    assert.equal(message.jobId, jobId);
    assert.equal(message.statusCode, 500);
    assert.equal(message.attempt, 2);
    assert.equal(dlq.messages.find((m) => m.value?.includes(run.id))?.key, jobId);
  },
);

test(
  'a target the policy refuses at execution time is dead after one attempt, not retried',
  { timeout: 30_000 },
  async () => {
    // Saved straight into the table, as if the policy had changed since the job was created.
    const { jobId } = await oneShot('/metadata', {
      target: { url: 'http://169.254.169.254/latest/meta-data/' },
      maxAttempts: 3,
      backoffMs: 100,
    });
    const run = await deadRunOf(jobId);
    assert.equal(run.attempt, 1, 'no second attempt');
    const { rows } = await fx.db.pool.query<{ attempt: number; error: string }>(
      'SELECT attempt, error FROM dead_letters WHERE run_id = $1',
      [run.id],
    );
    assert.equal(rows.length, 1);
    assert.match(rows[0]!.error, /169\.254/);
  },
);

test('a target that never answers is aborted at timeoutMs', { timeout: 30_000 }, async () => {
  const { jobId } = await oneShot('/silent', { timeoutMs: 1000, maxAttempts: 1 });
  const run = await deadRunOf(jobId);
  const [call] = fx.target.forJob(jobId);
  assert.ok(call?.aborted, 'the worker closed the connection');
  const heldOpen = call.endedAt! - call.arrivedAt;
  assert.ok(heldOpen >= 950 && heldOpen < 1300, `connection held ${heldOpen} ms`);
  const [attempt] = await attemptsOf(fx.db.pool, run.id);
  assert.equal(attempt?.outcome, 'timeout');
  assert.ok(attempt.durationMs! >= 1000 && attempt.durationMs! < 1300, `duration ${attempt.durationMs}`);
  assert.match(attempt.error ?? '', /timed out after 1000 ms/);
});

test("a poison job does not delay a healthy job's runs", { timeout: 40_000 }, async () => {
  const start = await nextWholeSecond(fx.db.pool, 1500);
  const every = { schedule: '* * * * * *', nextRunAt: start };
  const poison = await insertJob(fx.db.pool, {
    ...every,
    name: `poison-${uniqueId()}`,
    target: { url: `${fx.target.url}/poison` },
    maxAttempts: 3,
    backoffMs: 100,
    timeoutMs: 2000,
  });
  const healthy = await insertJob(fx.db.pool, {
    ...every,
    name: `healthy-${uniqueId()}`,
    target: { url: `${fx.target.url}/healthy` },
  });
  await sleep(start.getTime() - Date.now() + 6_000);
  await stopJobs(fx.db.pool, [poison, healthy]);
  await sleep(1500);

  const poisonRuns = await runsOf(fx.db.pool, poison);
  assert.ok(fx.target.forJob(poison).length >= 10, 'the poison job kept failing and retrying meanwhile');
  assert.ok(poisonRuns.filter((r) => r.state === 'dead').length >= 3, 'and its runs were dead-lettered');
  const healthyCalls = fx.target.forJob(healthy);
  assert.ok(healthyCalls.length >= 6, `healthy calls: ${healthyCalls.length}`);
  assert.ok(healthyCalls.every((c) => c.attempt === 1));
  const lateness = healthyCalls.map((c) => c.arrivedAt - Date.parse(c.scheduledFor));
  // On time means within tens of ms (the poison's retries and 300 ms failures never sit in front).
  assert.ok(
    Math.max(...lateness) < 200,
    `healthy lateness ms: ${lateness.map((l) => l.toFixed(1)).join(', ')}`,
  );
  assert.ok((await runsOf(fx.db.pool, healthy)).every((r) => r.state === 'succeeded'));
});
