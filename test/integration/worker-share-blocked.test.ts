import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';
import { describe, test } from 'node:test';
import { insertEverySecondJobs, waitFor } from '../support/execution.js';
import { integrationFixture } from '../support/fixture.js';
import { scrapeMetrics } from '../support/metrics.js';

// Leader work isolated (README, Architecture): the worker's statements use at most
// HELIOS_WORKER_DB_CONNECTIONS of the node's pool, and the leader's loops have a pool of their own.
// Here every statement the worker makes on run_attempts (its claims and completions) is held by a
// table lock for BLOCK_MS, so its connections stay taken for as long as the lock is held, whatever
// the machine's speed. With the gate the worker waits for its share and the readiness probe keeps
// a connection; the dispatcher, on its own pool, goes on creating runs. The second test takes the
// gate away (test/support/no-worker-gate.mjs, preloaded into the node) and shows the first one's
// readiness check failing; its dispatch check still passes, because of the leader's own pool: with
// the leader's loops moved to the node's pool it failed (0 runs created while blocked, 2026-12-06).
const POOL_SIZE = 3;
/** The default share: three quarters of the pool, rounded down (src/config/index.ts). */
const WORKER_SHARE = 2;
const HEALTHY_JOBS = 5;
const BLOCK_MS = 6000;
const NO_WORKER_GATE = fileURLToPath(new URL('../support/no-worker-gate.mjs', import.meta.url));

interface BlockedWorker {
  /** /readyz answers during the block, from its second second on (demand has built up by then). */
  readonly readiness: { status: number; body: string }[];
  /** Most sessions of the node's pool waiting for the lock at once. */
  readonly nodeSessionsWaiting: number;
  /** Most callers waiting for the worker's share at once (helios_db_pool_waiting). */
  readonly workerShareWaiting: number;
  /** Runs of the healthy jobs the dispatcher created while the worker was blocked. */
  readonly createdWhileBlocked: number;
  /** Occurrences due in the window around the block, and those of them called exactly once. */
  readonly occurrences: number;
  readonly calledOnce: number;
}

async function blockTheWorker(name: string, extra: Record<string, string> = {}): Promise<BlockedWorker> {
  // Calls take 300 ms, so some are in flight when the lock comes and their completions wait for it.
  const fx = await integrationFixture({ behaviour: () => ({ status: 200, delayMs: 300 }) });
  try {
    const { apiUrl } = await fx.start(
      name,
      { HELIOS_DATABASE_POOL_SIZE: String(POOL_SIZE), ...extra },
      { leader: true, worker: true },
    );
    const jobIds = await insertEverySecondJobs(fx.db.pool, `${fx.target.url}/ok`, HEALTHY_JOBS);
    await waitFor(
      'calls of the healthy jobs',
      () => fx.target.requests.length >= HEALTHY_JOBS * 3,
      30_000,
      100,
    );

    const locker = await fx.db.pool.connect();
    let blockedFrom: Date;
    let blockedTo: Date;
    const readiness: { status: number; body: string }[] = [];
    let nodeSessionsWaiting = 0;
    let workerShareWaiting = 0;
    try {
      await locker.query('BEGIN');
      // EXCLUSIVE: reads go on (the claim watch, the API), every write of run_attempts waits.
      await locker.query('LOCK TABLE run_attempts IN EXCLUSIVE MODE');
      blockedFrom = (await locker.query<{ now: Date }>('SELECT clock_timestamp() AS now')).rows[0]!.now;
      const startedAt = Date.now();
      while (Date.now() - startedAt < BLOCK_MS) {
        const [ready, waiting, metrics] = await Promise.all([
          fetch(`${apiUrl}/readyz`, { signal: AbortSignal.timeout(5000) }).then(async (r) => ({
            status: r.status,
            body: await r.text(),
          })),
          fx.db.pool.query<{ n: number }>(
            `SELECT count(*)::int AS n FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = $1 AND wait_event_type = 'Lock'`,
            [`helios-${name}`],
          ),
          scrapeMetrics(apiUrl),
        ]);
        if (Date.now() - startedAt >= 1000) readiness.push(ready);
        nodeSessionsWaiting = Math.max(nodeSessionsWaiting, waiting.rows[0]!.n);
        workerShareWaiting = Math.max(
          workerShareWaiting,
          metrics.value('helios_db_pool_waiting', { pool: 'worker' }) ?? 0,
        );
        await sleep(250);
      }
      blockedTo = (await locker.query<{ now: Date }>('SELECT clock_timestamp() AS now')).rows[0]!.now;
      await locker.query('COMMIT');
    } finally {
      locker.release();
    }

    const { rows: created } = await fx.db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM runs
       WHERE job_id = ANY($1::uuid[]) AND created_at > $2::timestamptz + interval '1 second' AND created_at < $3`,
      [jobIds, blockedFrom, blockedTo],
    );
    // Nothing lost meanwhile: every occurrence due from a second before the block to a second
    // after it is called once, late.
    const windowFrom = new Date(Math.floor(blockedFrom.getTime() / 1000) * 1000 - 1000);
    const windowTo = new Date(Math.ceil(blockedTo.getTime() / 1000) * 1000 + 1000);
    const seconds = (windowTo.getTime() - windowFrom.getTime()) / 1000;
    const occurrences = HEALTHY_JOBS * seconds;
    const callsPerOccurrence = () => {
      const calls = new Map<string, number>();
      for (const r of fx.target.requests) {
        const at = Date.parse(r.scheduledFor);
        if (at < windowFrom.getTime() || at >= windowTo.getTime()) continue;
        const key = `${r.jobId} ${at}`;
        calls.set(key, (calls.get(key) ?? 0) + 1);
      }
      return calls;
    };
    await waitFor("the window's calls", () => callsPerOccurrence().size >= occurrences, 30_000, 200).catch(
      () => undefined,
    );
    await sleep(500);
    const calledOnce = [...callsPerOccurrence().values()].filter((n) => n === 1).length;
    console.log(
      `# ${name}: ${created[0]!.n} runs created while blocked; node sessions waiting for the lock ${nodeSessionsWaiting}, ` +
        `callers waiting for the worker's share ${workerShareWaiting}; readiness ${readiness.map((r) => r.status).join(' ')}; ` +
        `${calledOnce}/${occurrences} occurrences called once`,
    );
    return {
      readiness,
      nodeSessionsWaiting,
      workerShareWaiting,
      createdWhileBlocked: created[0]!.n,
      occurrences,
      calledOnce,
    };
  } finally {
    await fx.teardown();
  }
}

/** The dispatcher kept its pace: a pass a second or so, each creating a second of every job's runs. */
function assertDispatchWentOn(blocked: BlockedWorker): void {
  const atLeast = HEALTHY_JOBS * (BLOCK_MS / 1000 - 3);
  assert.ok(
    blocked.createdWhileBlocked >= atLeast,
    `the dispatcher created ${blocked.createdWhileBlocked} runs while the worker was blocked (at least ${atLeast} expected)`,
  );
}

describe('the worker blocked in PostgreSQL', { concurrency: true }, () => {
  test('waits within its share: readiness answers and the leader dispatches on its own pool', async () => {
    const blocked = await blockTheWorker('share-gated');
    // The worker wanted more connections than its share: without the gate it would have had them.
    assert.ok(
      blocked.workerShareWaiting >= 1,
      'the worker never waited for its share: the test did not load it',
    );
    assert.ok(
      blocked.nodeSessionsWaiting <= WORKER_SHARE,
      `${blocked.nodeSessionsWaiting} sessions of the node's pool waited for the lock (the share is ${WORKER_SHARE})`,
    );
    assert.deepEqual(
      blocked.readiness.filter((r) => r.status !== 200),
      [],
      'readiness failed while the worker was blocked',
    );
    assertDispatchWentOn(blocked);
    assert.equal(
      blocked.calledOnce,
      blocked.occurrences,
      'an occurrence of the window was not called exactly once',
    );
  });

  test('without the gate takes every connection of the node: readiness fails, dispatch goes on', async () => {
    const blocked = await blockTheWorker('share-ungated', { NODE_OPTIONS: `--import ${NO_WORKER_GATE}` });
    assert.ok(
      blocked.nodeSessionsWaiting >= POOL_SIZE,
      `only ${blocked.nodeSessionsWaiting} sessions of the node's pool waited for the lock: the gate was not taken away`,
    );
    assert.ok(
      blocked.readiness.some((r) => r.status === 503 && r.body.includes('postgres')),
      `readiness answered ${blocked.readiness.map((r) => r.status).join(' ')}: the gated test's check could not fail`,
    );
    assertDispatchWentOn(blocked);
    assert.equal(
      blocked.calledOnce,
      blocked.occurrences,
      'an occurrence of the window was not called exactly once',
    );
  });
});
