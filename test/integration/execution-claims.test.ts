import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import pg from 'pg';
import { createKafka, RunPublisher } from '../../src/broker/index.js';
import type { Leadership } from '../../src/coordination/election.js';
import { FORGIVEN_EXPIRIES, Reaper } from '../../src/execution/reaper.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import {
  completeSucceeded,
  completeSucceededMany,
  failAttempt,
  type AttemptReport,
} from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { replayDeadLetter } from '../../src/store/dead-letters.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import { claimRun, explainClaimMiss, isForbidViolation, replaceOlderRuns } from '../../src/store/runs.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { attemptsOf, insertJob, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';

let fx: IntegrationFixture;
const topics = { runsTopic: 'claims.runs', deadLetterTopic: 'claims.dlq' };
const claim = (nodeId: string) => ({ nodeId, graceMs: 1000, skewToleranceMs: 0 });
const failed: AttemptReport = {
  outcome: 'failed',
  statusCode: 500,
  durationMs: 3,
  error: 'HTTP 500',
  responseExcerpt: 'boom',
};

before(async () => {
  fx = await integrationFixture();
});
after(() => fx.teardown());

/** A job (never dispatched: next_run_at NULL) and one run of it due at `notBefore`. */
async function jobWithRun(options: {
  concurrency?: 'allow' | 'forbid' | 'replace';
  maxAttempts?: number;
  backoffMs?: number;
  url?: string;
  notBeforeMs?: number;
}) {
  const jobId = await insertJob(fx.db.pool, {
    name: `job-${uniqueId()}`,
    schedule: '* * * * * *',
    target: { url: options.url ?? 'http://127.0.0.1:9/' },
    nextRunAt: new Date(0),
    concurrency: options.concurrency,
    maxAttempts: options.maxAttempts,
    backoffMs: options.backoffMs ?? 0,
  });
  await fx.db.pool.query('UPDATE jobs SET next_run_at = NULL WHERE id = $1', [jobId]);
  const runId = await addRun(jobId, 0, options.notBeforeMs ?? -1000);
  return { jobId, runId };
}

/** Adds a queued run `offsetS` seconds after the epoch-aligned base, due `notBeforeMs` from now. */
async function addRun(jobId: string, offsetS: number, notBeforeMs = -1000): Promise<string> {
  const { rows } = await fx.db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, date_trunc('second', now()) + $2 * interval '1 second', 'queued', max_attempts, target,
            timeout_ms, backoff_ms, backoff_multiplier, concurrency, now() + $3 * interval '1 millisecond'
     FROM jobs WHERE id = $1 RETURNING id`,
    [jobId, offsetS, notBeforeMs],
  );
  return rows[0]!.id;
}

/** Whether no transaction holds the run's row. */
async function rowUnlocked(runId: string): Promise<boolean> {
  try {
    await inTransaction(fx.db.pool, (c) =>
      c.query('SELECT 1 FROM runs WHERE id = $1 FOR UPDATE NOWAIT', [runId]),
    );
    return true;
  } catch (err) {
    if ((err as { code?: unknown }).code === '55P03') return false;
    throw err;
  }
}

async function run(runId: string) {
  const { rows } = await fx.db.pool.query<{
    state: string;
    attempt: number;
    claimedBy: string | null;
    reason: string | null;
  }>(`SELECT state, attempt, claimed_by AS "claimedBy", reason FROM runs WHERE id = $1`, [runId]);
  return rows[0]!;
}

function fakeLeadership(token: bigint): Leadership {
  return {
    nodeId: 'leader',
    token,
    since: new Date(),
    signal: new AbortController().signal,
    isValid: () => true,
  };
}

/** Makes the run's claim expire now and lets the leader's reaper take the run back. */
async function expireAndReap(runId: string): Promise<void> {
  await fx.db.pool.query(`UPDATE runs SET claim_expires_at = now() - interval '1 second' WHERE id = $1`, [
    runId,
  ]);
  const reaper = new Reaper({
    pool: fx.db.pool,
    leadership: fakeLeadership(1n),
    topics,
    intervalMs: 1000,
    logger: silentLogger,
    metrics: createMetrics('test'),
    onFenced: () => assert.fail('fenced'),
  });
  assert.deepEqual(await reaper.reapBatch(), { reaped: 1, full: false });
}

describe('claims and completions (PostgreSQL)', () => {
  test("a stale worker's completion after its claim expired does not overwrite the newer attempt", async () => {
    const { runId } = await jobWithRun({ maxAttempts: 3 });
    const first = await claimRun(fx.db.pool, runId, claim('worker-a'), 1);
    assert.equal(first?.attempt, 1);
    // worker-a stalls (GC pause, SIGSTOP) past its claim deadline; the leader's reaper recovers it.
    await expireAndReap(runId);
    assert.deepEqual(await run(runId), { state: 'queued', attempt: 1, claimedBy: null, reason: null });
    const second = await claimRun(fx.db.pool, runId, claim('worker-b'), 2);
    assert.equal(second?.attempt, 2);

    // worker-a wakes up and reports: success and failure are both discarded.
    const ok: AttemptReport = { ...failed, outcome: 'succeeded', statusCode: 200, error: null };
    assert.equal(await completeSucceeded(fx.db.pool, first, 'worker-a', ok), false);
    const stale = await inTransaction(fx.db.pool, (c) =>
      failAttempt(c, first, { nodeId: 'worker-a' }, failed, 0, topics),
    );
    assert.equal(stale, null);
    assert.deepEqual(await run(runId), { state: 'running', attempt: 2, claimedBy: 'worker-b', reason: null });

    assert.equal(await completeSucceeded(fx.db.pool, second, 'worker-b', ok), true);
    assert.equal((await run(runId)).state, 'succeeded');
    const attempts = await attemptsOf(fx.db.pool, runId);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.nodeId, a.outcome, a.statusCode]),
      [
        [1, 'worker-a', 'expired', null],
        [2, 'worker-b', 'succeeded', 200],
      ],
    );
    // The retry the reaper queued was announced through the outbox, as attempt 2.
    const { rows } = await fx.db.pool.query(`SELECT payload FROM outbox WHERE payload->>'runId' = $1`, [
      runId,
    ]);
    assert.deepEqual(
      rows.map((r: { payload: { attempt: number } }) => r.payload.attempt),
      [2],
    );
  });

  test("a stale attempt's completion in the same batch as the current one settles only the current one", async () => {
    const { runId } = await jobWithRun({ maxAttempts: 3 });
    const first = await claimRun(fx.db.pool, runId, claim('worker-a'), 1);
    // worker-a's attempt 1 outlives its claim; the reaper takes the run back and worker-a itself
    // claims attempt 2 (its poller), while attempt 1's call is still finishing.
    await expireAndReap(runId);
    const second = await claimRun(fx.db.pool, runId, claim('worker-a'), 2);
    assert.equal(second?.attempt, 2);
    const report = (statusCode: number, excerpt: string): AttemptReport => ({
      outcome: 'succeeded',
      statusCode,
      durationMs: 2,
      error: null,
      responseExcerpt: excerpt,
    });
    // Both calls end in the same turn: one completion batch.
    const settled = await completeSucceededMany(fx.db.pool, 'worker-a', [
      { run: first!, report: report(201, 'attempt one') },
      { run: second!, report: report(200, 'attempt two') },
    ]);
    assert.deepEqual(settled, [false, true]);
    const attempts = await attemptsOf(fx.db.pool, runId);
    assert.deepEqual(
      attempts.map((a) => [a.attempt, a.outcome, a.statusCode]),
      [
        [1, 'expired', null],
        [2, 'succeeded', 200],
      ],
    );
    const { rows } = await fx.db.pool.query<{ excerpt: string }>(
      'SELECT response_excerpt AS excerpt FROM run_attempts WHERE run_id = $1 AND attempt = 2',
      [runId],
    );
    assert.equal(rows[0]?.excerpt, 'attempt two');
    assert.equal((await run(runId)).state, 'succeeded');
  });

  test('a completion that waits on a concurrent writer of its run judges the version that writer committed', async () => {
    // Each writer's statement holds the row, not yet committed, when worker-a's completion
    // arrives: the completion waits for the row and must then re-check the committed version.
    const cases = [
      {
        writer: 'the reaper taking the run back',
        set: `state = 'queued', claimed_by = NULL, claim_expires_at = NULL`,
        settles: false,
      },
      {
        writer: 'a replace ending it (state only)',
        set: `state = 'failed', reason = 'replaced'`,
        settles: false,
      },
      {
        writer: 'a write that keeps the claim',
        set: `claim_expires_at = claim_expires_at + interval '1 second'`,
        settles: true,
      },
    ];
    for (const { writer, set, settles } of cases) {
      const { runId } = await jobWithRun({ maxAttempts: 3 });
      const claimed = await claimRun(fx.db.pool, runId, claim('worker-a'), 1);
      assert.equal(claimed?.attempt, 1);
      const other = await fx.db.pool.connect();
      try {
        await other.query('BEGIN');
        await other.query(`UPDATE runs SET ${set} WHERE id = $1`, [runId]);
        const ok: AttemptReport = { ...failed, outcome: 'succeeded', statusCode: 200, error: null };
        const completion = completeSucceeded(fx.db.pool, claimed!, 'worker-a', ok);
        await waitFor(`the completion waiting for the row (${writer})`, async () => {
          const { rowCount } = await fx.db.pool.query(
            `SELECT 1 FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%succeeded%'`,
          );
          return rowCount! > 0 || null;
        });
        await other.query('COMMIT');
        assert.equal(await completion, settles, writer);
      } finally {
        other.release();
      }
      const attempts = await attemptsOf(fx.db.pool, runId);
      assert.deepEqual(
        attempts.map((a) => [a.attempt, a.outcome]),
        [[1, settles ? 'succeeded' : null]],
        writer,
      );
      // Queued and overdue, it would be a later test's polling claim.
      await fx.db.pool.query('DELETE FROM runs WHERE id = $1', [runId]);
    }
  });

  test('a claim succeeds once: the same run claimed by two workers at once runs once', async () => {
    const { runId } = await jobWithRun({});
    const results = await Promise.all(
      Array.from({ length: 8 }, (_, i) => claimRun(fx.db.pool, runId, claim(`w${i}`), 1)),
    );
    assert.equal(results.filter(Boolean).length, 1);
    assert.equal((await attemptsOf(fx.db.pool, runId)).length, 1);
  });

  test('a run is not claimed before not_before, beyond the skew tolerance', async () => {
    const { runId } = await jobWithRun({ notBeforeMs: 500 });
    assert.equal(await claimRun(fx.db.pool, runId, claim('w'), 1), null);
    const miss = await explainClaimMiss(fx.db.pool, runId);
    assert.equal(miss?.state, 'queued');
    assert.ok(miss!.dueInMs > 300 && miss!.dueInMs <= 500, `dueInMs ${miss?.dueInMs}`);
    assert.ok(await claimRun(fx.db.pool, runId, { ...claim('w'), skewToleranceMs: 600 }, 1));
  });

  test('forbid: a second run of the job never runs beside the first, it is skipped', async () => {
    const { jobId, runId } = await jobWithRun({ concurrency: 'forbid' });
    const second = await addRun(jobId, 1);
    assert.ok(await claimRun(fx.db.pool, runId, claim('w1'), 1));
    await assert.rejects(claimRun(fx.db.pool, second, claim('w2'), 1), (err) => isForbidViolation(err));
    // PostgreSQL reports the refusal before its transaction has ended: until it has, the row is
    // locked, and the poll's SKIP LOCKED would pass it over (another poll takes it later).
    await waitFor('the refused claim to release its row', () => rowUnlocked(second));
    // The polling path skips it the same way, inside its SKIP LOCKED batch.
    const polled = await inTransaction(fx.db.pool, (client) => claimOverdueRuns(client, 0, 10, claim('w2')));
    assert.deepEqual([polled.claimed.length, polled.skipped], [0, 1]);
    assert.deepEqual(await run(second), {
      state: 'skipped',
      attempt: 0,
      claimedBy: null,
      reason: 'concurrency-forbid',
    });
  });

  test('forbid: a new occurrence is not started while an earlier run waits to retry', async () => {
    const { jobId, runId } = await jobWithRun({ concurrency: 'forbid', maxAttempts: 3, backoffMs: 60_000 });
    const first = await claimRun(fx.db.pool, runId, claim('w1'), 1);
    await inTransaction(fx.db.pool, (c) => failAttempt(c, first!, { nodeId: 'w1' }, failed, 60_000, topics));
    const next = await addRun(jobId, 1);
    assert.equal(await claimRun(fx.db.pool, next, claim('w2'), 1), null);
    assert.equal((await explainClaimMiss(fx.db.pool, next))?.forbidBlocked, true);
  });

  test('replace: the newer claim fails the running run and NOTIFYs its worker', async () => {
    const { jobId, runId } = await jobWithRun({ concurrency: 'replace' });
    const newer = await addRun(jobId, 1);
    const listener = new pg.Client({ connectionString: fx.db.url });
    await listener.connect();
    try {
      const notified: string[] = [];
      listener.on('notification', (n) => notified.push(n.payload ?? ''));
      await listener.query('LISTEN helios_runs');
      assert.ok(await claimRun(fx.db.pool, runId, claim('w1'), 1));
      assert.deepEqual(await replaceOlderRuns(fx.db.pool, jobId), {
        replaced: [],
        running: { id: runId, attempt: 1, nodeId: 'w1' },
      });
      assert.ok(await claimRun(fx.db.pool, newer, claim('w2'), 1));
      assert.deepEqual(await replaceOlderRuns(fx.db.pool, jobId), {
        replaced: [runId],
        running: { id: newer, attempt: 1, nodeId: 'w2' },
      });
      assert.deepEqual(await run(runId), {
        state: 'failed',
        attempt: 1,
        claimedBy: 'w1',
        reason: 'replaced',
      });
      assert.equal((await attemptsOf(fx.db.pool, runId))[0]?.outcome, 'replaced');
      assert.equal((await run(newer)).state, 'running');
      await waitFor('the notification', () => notified.includes(runId), 5000);
    } finally {
      await listener.end();
    }
  });

  test('the last failed attempt makes the run dead; a replay re-queues it once with a fresh budget', async () => {
    const { runId } = await jobWithRun({ maxAttempts: 1 });
    const claimed = await claimRun(fx.db.pool, runId, claim('w'), 1);
    const result = await inTransaction(fx.db.pool, (c) =>
      failAttempt(c, claimed!, { nodeId: 'w' }, failed, 0, topics),
    );
    assert.equal(result?.state, 'dead');
    const letters = await fx.db.pool.query<{ id: string; statusCode: number; error: string }>(
      `SELECT id, status_code AS "statusCode", error FROM dead_letters WHERE run_id = $1`,
      [runId],
    );
    assert.deepEqual(
      letters.rows.map((l) => [l.statusCode, l.error]),
      [[500, 'HTTP 500']],
    );
    const dlq = await fx.db.pool.query(`SELECT payload FROM outbox WHERE topic = $1 AND key <> ''`, [
      topics.deadLetterTopic,
    ]);
    assert.ok(dlq.rows.some((r: { payload: { runId: string } }) => r.payload.runId === runId));

    const id = letters.rows[0]!.id;
    assert.deepEqual(await replayDeadLetter(fx.db.pool, id, topics), {
      runId,
      jobId: (await fx.db.pool.query(`SELECT job_id FROM runs WHERE id = $1`, [runId])).rows[0].job_id,
      attempt: 2,
    });
    assert.equal(await replayDeadLetter(fx.db.pool, id, topics), null, 'a second replay does nothing');
    assert.equal(await replayDeadLetter(fx.db.pool, '00000000-0000-4000-8000-000000000000', topics), null);
    assert.equal(await replayDeadLetter(fx.db.pool, 'not-a-uuid', topics), null);
    const after = await fx.db.pool.query(`SELECT state, max_attempts FROM runs WHERE id = $1`, [runId]);
    assert.deepEqual(after.rows[0], { state: 'queued', max_attempts: 2 });
    assert.ok(await claimRun(fx.db.pool, runId, claim('w'), 2), 'the replayed attempt can be claimed');
  });

  test("a job a command holds does not stall the reaper: other jobs' runs are recovered, its own after the command", async () => {
    // J's run has used up its forgiven expiries and its last attempt: the reaper buries it, and a
    // dead letter's foreign key takes a share lock on J's row. K's run is an ordinary retry.
    const held = await jobWithRun({ maxAttempts: 1 });
    const other = await jobWithRun({ maxAttempts: 3 });
    for (const { runId } of [held, other]) {
      assert.ok(await claimRun(fx.db.pool, runId, claim('worker-a'), 1));
    }
    await fx.db.pool.query(
      `UPDATE runs SET claim_expires_at = now() - interval '1 second',
                       expiries = CASE WHEN id = $1 THEN $3 ELSE 0 END
       WHERE id IN ($1, $2)`,
      [held.runId, other.runId, FORGIVEN_EXPIRIES],
    );
    const reaper = new Reaper({
      pool: fx.db.pool,
      leadership: fakeLeadership(1n),
      topics,
      intervalMs: 1000,
      logger: silentLogger,
      metrics: createMetrics('test'),
      onFenced: () => assert.fail('fenced'),
    });

    // A pause, an edit or a delete of J holds its row (findJob ... FOR UPDATE) for as long as it
    // takes: up to its lock patience (30 s) when it waits for runs other statements hold.
    const command = await fx.db.pool.connect();
    try {
      await command.query('BEGIN');
      await command.query('SELECT id FROM jobs WHERE id = $1 FOR UPDATE', [held.jobId]);
      const pass = reaper.reapBatch();
      const stalled = await Promise.race([
        pass.then(() => false),
        new Promise<boolean>((r) => setTimeout(r, 3000, true)),
      ]);
      assert.equal(stalled, false, 'the pass waited for the job the command holds');
      assert.equal((await run(other.runId)).state, 'queued', "the other job's run is recovered");
      assert.deepEqual(await run(held.runId), {
        state: 'running',
        attempt: 1,
        claimedBy: 'worker-a',
        reason: null,
      });
    } finally {
      await command.query('ROLLBACK');
      command.release();
    }
    await reaper.reapBatch();
    assert.equal((await run(held.runId)).state, 'dead', 'buried once the command ended');
    // The retry left queued would be claimed by the nodes of the tests below (their polling).
    await fx.db.pool.query('DELETE FROM jobs WHERE id IN ($1, $2)', [held.jobId, other.jobId]);
  });
});

describe('two workers receive the same run message', { timeout: 90_000 }, () => {
  const kafka = createKafka({
    brokers: serverEnv().kafkaBrokers.split(','),
    clientId: 'claims-test',
    logger: silentLogger,
  });
  const publisher = new RunPublisher({ kafka, logger: silentLogger });

  after(() => publisher.disconnect());

  test('published twice to two consumer groups: exactly one HTTP call', async () => {
    // Separate consumer groups: each worker surely receives every copy of the message.
    for (const name of ['dup-a', 'dup-b']) {
      fx.spawn(name, { HELIOS_ROLES: 'worker', HELIOS_KAFKA_GROUP: `${fx.topic}.${name}` });
    }
    await Promise.all(fx.nodes.map((n) => n.waitForLog((l) => l.msg === 'joined consumer group', 30_000)));
    const { jobId, runId } = await jobWithRun({ url: fx.target.url, notBeforeMs: 1500 });
    const { rows } = await fx.db.pool.query<{ scheduledFor: Date; notBefore: Date }>(
      `SELECT scheduled_for AS "scheduledFor", not_before AS "notBefore" FROM runs WHERE id = $1`,
      [runId],
    );
    const value = JSON.stringify({ runId, jobId, attempt: 1, ...rows[0] });
    await publisher.connect();
    await publisher.publish(fx.topic, [{ key: jobId, value }]);
    await publisher.publish(fx.topic, [{ key: jobId, value }]);

    await waitFor('the run to succeed', async () => (await run(runId)).state === 'succeeded', 15_000);
    await new Promise((r) => setTimeout(r, 1500)); // room for a second, wrong call to arrive
    assert.equal(fx.target.requests.filter((r) => r.runId === runId).length, 1);

    // Both workers really raced for it: each tried to claim, one won.
    const claims = await Promise.all(
      fx.nodes.map(async (node) => {
        const started = await node.waitForLog((l) => l.msg === 'node started');
        const text = await (await fetch(`${String(started.apiUrl)}/metrics`)).text();
        return {
          claimed: metric(text, 'helios_run_claims_total', 'result="claimed"'),
          missed: metric(text, 'helios_run_claims_total', 'result="missed"'),
        };
      }),
    );
    assert.equal(
      claims.reduce((n, c) => n + c.claimed, 0),
      1,
      JSON.stringify(claims),
    );
    assert.ok(
      claims.every((c) => c.claimed + c.missed >= 1),
      JSON.stringify(claims),
    );
  });
});

/** Sum of a Prometheus counter's samples whose labels contain `labels`. */
function metric(text: string, name: string, labels: string): number {
  return text
    .split('\n')
    .filter((line) => line.startsWith(`${name}{`) && line.includes(labels))
    .reduce((sum, line) => sum + Number(line.split(' ').at(-1)), 0);
}
