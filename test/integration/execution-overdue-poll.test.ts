import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type pg from 'pg';
import { setTimeout as sleep } from 'node:timers/promises';
import { inTransaction } from '../../src/store/db.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import { claimRun, isForbidViolation, skipRun } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { uniqueId } from '../support/env.js';
import { insertJob } from '../support/execution.js';

// The polling fallback's transaction after an outage, when several overdue runs of a `forbid` job
// wait at once (chaos seed 6). Its claims count from the transaction's start (now()), and its skips
// are judged against whatever runs meanwhile: the transaction must stay one statement long.

let db: TestDatabase;
const claimOptions = (nodeId: string, graceMs = 3000) => ({ nodeId, graceMs, skewToleranceMs: 10 });
/** The start of a CLAIM statement (store/runs.ts). */
const isClaim = (sql: string) => sql.trimStart().startsWith('WITH input AS');

before(async () => {
  db = await createTestDatabase();
});
after(async () => {
  await db.drop();
});

async function job(concurrency: 'allow' | 'forbid'): Promise<string> {
  const jobId = await insertJob(db.pool, {
    name: `job-${uniqueId()}`,
    schedule: '* * * * * *',
    target: { url: 'http://127.0.0.1:9/' },
    nextRunAt: new Date(0),
    concurrency,
    timeoutMs: 5000,
  });
  await db.pool.query('UPDATE jobs SET next_run_at = NULL WHERE id = $1', [jobId]);
  return jobId;
}

/** A fresh queued run of `jobId`, scheduled and due `agoMs` before now (negative: ahead). */
async function addRun(jobId: string, agoMs: number): Promise<string> {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT id, now() - $2 * interval '1 millisecond', 'queued', max_attempts, target, timeout_ms,
            backoff_ms, backoff_multiplier, concurrency, now() - $2 * interval '1 millisecond'
     FROM jobs WHERE id = $1 RETURNING id`,
    [jobId, agoMs],
  );
  return rows[0]!.id;
}

/** Only this test's runs are overdue: the poll of one test must not claim another's leftovers. */
async function settleOthers(): Promise<void> {
  await db.pool.query(`UPDATE runs SET state = 'failed', finished_at = now() WHERE state = 'queued'`);
}

/** The client, with `hook` run after each statement (whether it failed or not). */
function hooked(client: pg.PoolClient, hook: (sql: string) => Promise<void>): pg.PoolClient {
  const query = client.query.bind(client) as (...args: unknown[]) => Promise<unknown>;
  return new Proxy(client, {
    get(target, property) {
      if (property !== 'query') return Reflect.get(target, property) as unknown;
      return async (...args: unknown[]) => {
        try {
          return await query(...args);
        } finally {
          // A named statement (store/runs.ts) comes as a config object: its text is `text`.
          const [first] = args as [string | { text: string }];
          await hook(typeof first === 'string' ? first : first.text);
        }
      };
    },
  });
}

interface RunState {
  id: string;
  state: string;
  reason: string | null;
  scheduledFor: Date;
  startedAt: Date | null;
  finishedAt: Date | null;
  claimExpiresAt: Date | null;
}

async function runsOf(jobId: string): Promise<RunState[]> {
  const { rows } = await db.pool.query<RunState>(
    `SELECT id, state, reason, scheduled_for AS "scheduledFor", started_at AS "startedAt",
            finished_at AS "finishedAt", claim_expires_at AS "claimExpiresAt"
     FROM runs WHERE job_id = $1 ORDER BY scheduled_for`,
    [jobId],
  );
  return rows;
}

describe('the overdue poll with several runs of a forbid job', () => {
  test('the oldest overdue forbid occurrence runs; a newer one claimed meanwhile does not make both skipped', async () => {
    await settleOthers();
    const forbid = await job('forbid');
    // After a 30 s etcd outage the new leader created these at once (seed 6: due 22:36:38, :40, :44).
    const r38 = await addRun(forbid, 6000);
    const r40 = await addRun(forbid, 4000);
    const r44 = await addRun(forbid, 100); // due, but not yet overdue: the Kafka path's
    const others = [await job('allow'), await job('allow')];
    for (const id of others) await addRun(id, 5000);

    // Another worker's Kafka path claims r44 once it is due, while the poll's transaction is on
    // (seed 6: the poll began 22:36:43.664; chaos-a claimed :44 at 22:36:44.027).
    let kafka: Promise<unknown> | undefined;
    await inTransaction(db.pool, (client) =>
      claimOverdueRuns(
        hooked(client, async (sql) => {
          if (kafka || !isClaim(sql)) return;
          kafka = claimRun(db.pool, r44, claimOptions('chaos-a'), 1).catch((err: unknown) => err);
          // It commits at once, or waits for the poll's claim of r38 (then the poll must go on).
          await Promise.race([kafka, sleep(300)]);
        }),
        2000,
        64,
        claimOptions('chaos-b'),
      ),
    );
    const kafkaResult = await kafka;

    const runs = await runsOf(forbid);
    // What the chaos checker asks of every forbid skip: another run of the job was active when
    // the skip was decided (it had started by the skip's time and had not ended before the skipped
    // run was due). Before the fix both r38 and r40 were skipped at the poll's start, before r44
    // (the only run that ever ran) had started.
    for (const skipped of runs.filter((r) => r.state === 'skipped')) {
      const sibling = runs.find(
        (o) =>
          o.id !== skipped.id &&
          o.startedAt !== null &&
          o.startedAt <= skipped.finishedAt! &&
          (o.finishedAt === null || o.finishedAt >= skipped.scheduledFor),
      );
      assert.ok(sibling, `run due ${skipped.scheduledFor.toISOString()} skipped with no other run active`);
    }
    const byId = new Map(runs.map((r) => [r.id, r]));
    assert.equal(byId.get(r38)!.state, 'running', 'the oldest overdue occurrence is claimed by the poll');
    assert.deepEqual([byId.get(r40)!.state, byId.get(r40)!.reason], ['skipped', 'concurrency-forbid']);
    // r44 found r38 running: its claim fails on the forbid index (the Kafka path then skips it).
    assert.ok(isForbidViolation(kafkaResult), `the Kafka claim of r44 ended ${String(kafkaResult)}`);
    assert.equal(byId.get(r44)!.state, 'queued');
  });

  test('claims of a slow poll leave the worker a whole timeout to call: no hand-back as too late', async () => {
    await settleOthers();
    // PostgreSQL just restarted (seed 6, 22:43:26): every statement is slow, and the overdue runs
    // include three of one forbid job. Before the fix the batch failed on them and the poll claimed
    // 63 runs one by one for 4.4 s; their deadlines counted from its start, so each arrived with
    // 3.6 s left, under the 5 s timeout, and all were handed back (three of them lost to a delete).
    const forbid = await job('forbid');
    for (const ago of [6000, 4000, 2000]) await addRun(forbid, ago);
    for (let i = 0; i < 12; i++) await addRun(await job('allow'), 3000);
    const slowMs = 80;
    const graceMs = 3000;
    const claimed = await inTransaction(db.pool, async (client) => {
      const { claimed } = await claimOverdueRuns(
        hooked(client, () => sleep(slowMs)),
        0,
        64,
        claimOptions('chaos-b', graceMs),
      );
      return claimed;
    });
    // The worker starts the calls once the transaction has committed: now.
    const { rows } = await db.pool.query<{ now: Date }>('SELECT clock_timestamp() AS now');
    const committedAt = rows[0]!.now.getTime();
    assert.equal(claimed.length, 13);
    for (const run of claimed) {
      // attempt.ts: a claim with no more than the run's timeout left is handed back, call not made.
      const leftMs = run.claimExpiresAt.getTime() - committedAt;
      assert.ok(leftMs > run.timeoutMs, `claim of ${run.id} had ${leftMs} ms left at commit`);
    }
  });

  test('a claim and a skip inside a longer transaction count from their own statement, not its start', async () => {
    await settleOthers();
    const forbid = await job('forbid');
    const first = await addRun(forbid, 2000);
    const second = await addRun(forbid, 1000);
    const graceMs = 3000;
    const { claimedAt, skippedAt, claim } = await inTransaction(db.pool, async (client) => {
      await client.query('SELECT now()'); // the transaction's clock starts here
      await sleep(700);
      const claimedAt = (await client.query<{ at: Date }>('SELECT clock_timestamp() AS at')).rows[0]!.at;
      const claim = await claimRun(client, first, claimOptions('chaos-b', graceMs), 1);
      await sleep(700);
      const skippedAt = (await client.query<{ at: Date }>('SELECT clock_timestamp() AS at')).rows[0]!.at;
      assert.ok(await skipRun(client, second, 'concurrency-forbid'));
      return { claimedAt, skippedAt, claim };
    });
    // The deadline leaves the whole timeout and grace from the claim; the skip says when it was
    // decided (the chaos checker judges a forbid skip against the runs active at that instant).
    assert.ok(claim!.claimExpiresAt.getTime() >= claimedAt.getTime() + claim!.timeoutMs + graceMs);
    const skipped = (await runsOf(forbid)).find((r) => r.id === second)!;
    assert.ok(
      skipped.finishedAt!.getTime() >= skippedAt.getTime(),
      `skip recorded at ${skipped.finishedAt!.toISOString()}, decided after ${skippedAt.toISOString()}`,
    );
  });
});
