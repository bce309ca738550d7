import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import { createKafka, RunPublisher } from '../../src/broker/index.js';
import { loadConfig } from '../../src/config/index.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { HeliosNode } from '../../src/node.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { inTransaction } from '../../src/store/db.js';
import { PoolShare, poolStats } from '../../src/store/pool-share.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { waitFor } from '../support/execution.js';
import { parseMetrics, type Scrape } from '../support/metrics.js';
import { nodeEnvironment } from '../support/processes.js';

// Issue 13, signals: a scripted scenario puts the cluster in a known state, and every new gauge
// and counter must then show the value that state implies. Two nodes in this process:
// the leader (scheduler, api) computes the cluster gauges; a worker in another consumer group
// claims runs, so the leader's group (no consumer) shows the exact lag of what was published.
const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const prefix = `/helios-test/${uniqueId()}`;
const topic = `helios.test.${uniqueId()}`;
const LAG_MESSAGES = 7;
let db: TestDatabase;
let leader: HeliosNode;
let worker: HeliosNode;
let releaseRelay: () => void = () => undefined;
const relayHeld = new Promise<void>((resolve) => (releaseRelay = resolve));

const env = (id: string, extra: Record<string, string>) =>
  nodeEnvironment(id, {
    databaseUrl: db.url,
    etcdPrefix: prefix,
    topic,
    extra: { HELIOS_LOG_LEVEL: 'silent', ...extra },
  });

async function scrape(node: HeliosNode): Promise<Scrape> {
  return parseMetrics(await node.metrics.registry.metrics());
}

/** Job ids of the scenario, by role. */
const jobs: Record<'forbid' | 'misfired' | 'dead' | 'parked', string> = {
  forbid: '',
  misfired: '',
  dead: '',
  parked: '',
};

before(async () => {
  db = await createTestDatabase();
  const insertJob = async (
    name: string,
    schedule: string,
    nextRunAt: string | null,
    concurrency = 'allow',
  ) => {
    const { rows } = await db.pool.query<{ id: string }>(
      `INSERT INTO jobs (name, schedule, target, concurrency, next_run_at, enabled)
       VALUES ($1, $2, '{"url": "http://127.0.0.1:9/unused"}', $3, $4::timestamptz, $4::timestamptz IS NOT NULL) RETURNING id`,
      [name, schedule, concurrency, nextRunAt],
    );
    return rows[0]!.id;
  };
  // A forbid job with a run that another (imaginary) worker holds for an hour: its queued
  // retries wait for it (they are neither claimed nor skipped), so they stay queued.
  jobs.forbid = await insertJob('forbid', '0 0 0 1 1 *', null, 'forbid');
  // Misfired: a yearly job last due before 2024: 2024-01-01, 2025-01-01 and 2026-01-01 are late;
  // fire-once fires the latest and drops two. It is a forbid job with a running run too, so its
  // fresh occurrence is skipped at claim time (reason concurrency-forbid).
  jobs.misfired = await insertJob('misfired', '0 0 0 1 1 *', '2023-06-01T00:00:00Z', 'forbid');
  jobs.dead = await insertJob('dead', '0 0 0 1 1 *', null);
  // A schedule the dispatcher cannot evaluate: parked.
  jobs.parked = await insertJob('parked', 'not a schedule', new Date(Date.now() - 1000).toISOString());
  await db.pool.query(
    // Started (its call began): a running run claimed ahead and never started is taken back by the
    // leader's reaper a claim grace after it fell due.
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before, claimed_by, claim_expires_at, started_at)
     SELECT $1::uuid, '2020-01-01'::timestamptz, 'running', 1, 3, '{"url": "http://127.0.0.1:9/"}'::jsonb, 5000, 1000, 2,
            'forbid', now() - interval '1 hour', 'ghost', now() + interval '1 hour', now() - interval '1 hour'
     UNION ALL
     SELECT $2::uuid, '2020-01-01'::timestamptz, 'running', 1, 3, '{"url": "http://127.0.0.1:9/"}'::jsonb, 5000, 1000, 2,
            'forbid', now() - interval '1 hour', 'ghost', now() + interval '1 hour', now() - interval '1 hour'`,
    [jobs.forbid, jobs.misfired],
  );
  // Queued retries of the forbid job: three due an hour ago, waiting for the held run (counted as
  // waiting, not overdue), two due in an hour.
  await db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT $1::uuid, '2021-01-01'::timestamptz + i * interval '1 day', 'queued', 1, 3, '{"url": "http://127.0.0.1:9/"}'::jsonb,
            5000, 1000, 2, 'forbid', now() + CASE WHEN i <= 3 THEN interval '-1 hour' ELSE interval '1 hour' END
     FROM generate_series(1, 5) AS i`,
    [jobs.forbid],
  );
  // Three dead runs with dead letters, one of them replayed already: two open.
  await db.pool.query(
    `WITH dead AS (
       INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms, backoff_ms,
                         backoff_multiplier, not_before, finished_at)
       SELECT $1::uuid, '2022-01-01'::timestamptz + i * interval '1 day', 'dead', 3, 3, '{"url": "http://127.0.0.1:9/"}'::jsonb,
              5000, 1000, 2, now(), now()
       FROM generate_series(1, 3) AS i RETURNING id, scheduled_for)
     INSERT INTO dead_letters (run_id, job_id, attempt, replayed_at)
     SELECT id, $1::uuid, 3, CASE WHEN scheduled_for = '2022-01-02' THEN now() END FROM dead`,
    [jobs.dead],
  );
  // Four outbox rows waiting 40 s already; the relay is held at its first publish (below), so
  // they and every later row stay pending.
  await db.pool.query(
    `INSERT INTO outbox (topic, key, payload, publish_after, created_at)
     SELECT $1, 'k' || i, '{}', now() - interval '40 seconds', now() - interval '40 seconds'
     FROM generate_series(1, 4) AS i`,
    [topic],
  );

  leader = new HeliosNode({
    config: loadConfig(
      env('metrics-leader', { HELIOS_ROLES: 'scheduler,api', HELIOS_SIGNALS_INTERVAL_MS: '200' }),
    ),
    logger: silentLogger,
    beforePublish: () => relayHeld,
  });
  await leader.start();
  worker = new HeliosNode({
    config: loadConfig(
      env('metrics-worker', {
        HELIOS_ROLES: 'worker',
        HELIOS_KAFKA_GROUP: `${topic}.other-workers`,
        HELIOS_DATABASE_POOL_SIZE: '6',
        HELIOS_POLL_OVERDUE_MS: '0',
        HELIOS_POLL_INTERVAL_MS: '200',
      }),
    ),
    logger: silentLogger,
  });
  await worker.start();
});

after(async () => {
  releaseRelay();
  await Promise.allSettled([worker?.stop(), leader?.stop()]);
  await db.drop();
  await etcd.delete().prefix(prefix);
  etcd.close();
});

test('after a scripted scenario every cluster gauge and new counter shows the expected value', async () => {
  // Published straight to the runs topic, not through the outbox: the leader's consumer group
  // has no member, so all of them are its lag. The worker (another group) rejects them as not
  // run announcements, which changes nothing here.
  const publisher = new RunPublisher({
    kafka: createKafka({
      brokers: serverEnv().kafkaBrokers.split(','),
      clientId: 'metrics-test',
      logger: silentLogger,
    }),
    logger: silentLogger,
  });
  try {
    await waitFor(
      'the runs topic',
      () =>
        publisher
          .publish(
            topic,
            Array.from({ length: LAG_MESSAGES }, (_, i) => ({ key: `lag-${i}`, value: '{"not":"a run"}' })),
          )
          .then(
            () => true,
            () => false,
          ),
      30_000,
      500,
    );
  } finally {
    await publisher.disconnect();
  }

  const expected = {
    helios_outbox_pending_rows: 5, // the four old rows and the misfired job's run
    helios_runs_queued: 5,
    helios_runs_overdue: 0,
    helios_runs_waiting_forbid: 3,
    helios_runs_running: 2,
    helios_dead_letters_open: 2,
    helios_kafka_consumer_lag_messages: LAG_MESSAGES,
  };
  const settled = await waitFor(
    'the scenario to settle in the gauges',
    async () => {
      const [l, w] = [await scrape(leader), await scrape(worker)];
      const ready =
        l.sum('helios_runs_skipped_total', { reason: 'concurrency-forbid' }) +
          w.sum('helios_runs_skipped_total', { reason: 'concurrency-forbid' }) ===
          1 && Object.entries(expected).every(([name, value]) => l.value(name) === value);
      return ready ? { l, w } : null;
    },
    30_000,
    200,
  ).catch(async (err: unknown) => {
    const l = await scrape(leader);
    const seen = Object.fromEntries(Object.keys(expected).map((name) => [name, l.value(name)]));
    throw new Error(`${(err as Error).message}; gauges ${JSON.stringify(seen)}`);
  });
  const { l, w } = settled;

  const age = l.value('helios_outbox_oldest_pending_age_seconds')!;
  assert.ok(age >= 40 && age < 120, `oldest pending outbox row is ${age} s old, expected about 40`);
  assert.ok(l.value('helios_cluster_signals_updated_timestamp_seconds')! > Date.now() / 1000 - 10);
  assert.equal(l.value('helios_misfires_total', { policy: 'fire-once' }), 1);
  assert.equal(l.find('helios_misfires_total').length, 1, 'misfires of another policy');
  assert.equal(l.value('helios_jobs_parked_total'), 1);
  // The skipped occurrence is the misfired job's 2026-01-01 run, skipped by the worker.
  assert.equal(w.value('helios_runs_skipped_total', { reason: 'concurrency-forbid' }), 1);
  const { rows } = await db.pool.query<{ reason: string }>(`SELECT reason FROM runs WHERE state = 'skipped'`);
  assert.deepEqual(rows, [{ reason: 'concurrency-forbid' }]);

  // Pools: the configured sizes, and nothing waiting at rest.
  assert.equal(l.value('helios_db_pool_size', { pool: 'main' }), 20);
  assert.equal(l.value('helios_db_pool_size', { pool: 'leader' }), 5);
  assert.equal(w.value('helios_db_pool_size', { pool: 'main' }), 6);
  assert.equal(w.value('helios_db_pool_size', { pool: 'worker' }), 4);
  assert.equal(w.value('helios_db_pool_size', { pool: 'leader' }), undefined, 'a worker has no leader pool');
  for (const scrape of [l, w])
    for (const sample of scrape.find('helios_db_pool_waiting'))
      assert.equal(sample.value, 0, sample.labels.pool);

  // The cluster gauges are the leader's alone: a follower exports none of them.
  for (const name of Object.keys(expected)) assert.equal(w.find(name).length, 0, `${name} on a follower`);
});

test('a pool share counts connections in use and callers waiting, and the pool gauges show them', async () => {
  const pool = new pg.Pool({ connectionString: db.url, max: 3 });
  const share = new PoolShare(pool, 1);
  const metrics = createMetrics('share-test');
  metrics.trackPool('worker', share);
  let release!: () => void;
  const held = new Promise<void>((resolve) => (release = resolve));
  try {
    const first = inTransaction(share, async (client) => {
      await client.query('SELECT 1');
      await held;
    });
    await waitFor('the first checkout', () => share.inUse === 1);
    const second = share.query('SELECT 2 AS n');
    // Awaited below; if an assertion fails first, its end (the pool ended) must not mask the failure.
    second.catch(() => undefined);
    await waitFor('the second caller to wait', () => share.waiting === 1);
    await sleep(500);
    const during = parseMetrics(await metrics.registry.metrics());
    assert.equal(during.value('helios_db_pool_in_use', { pool: 'worker' }), 1);
    assert.equal(during.value('helios_db_pool_waiting', { pool: 'worker' }), 1);
    assert.equal(pool.totalCount, 1, 'the waiting caller took no connection of the pool');
    // The time the caller has waited is counted (sampled every 100 ms), whatever a scrape reads.
    const waited = during.value('helios_db_pool_saturated_seconds_total', { pool: 'worker' })!;
    assert.ok(waited >= 0.3 && waited <= 1, `counted ${waited} s of waiting, expected about 0.5`);
    release();
    await first;
    assert.equal((await second).rows[0].n, 2);
    const afterwards = parseMetrics(await metrics.registry.metrics());
    assert.equal(afterwards.value('helios_db_pool_in_use', { pool: 'worker' }), 0);
    assert.equal(afterwards.value('helios_db_pool_waiting', { pool: 'worker' }), 0);
    await sleep(300);
    const idle = parseMetrics(await metrics.registry.metrics());
    assert.ok(
      idle.value('helios_db_pool_saturated_seconds_total', { pool: 'worker' })! - waited < 0.3,
      'no more waiting counted once the caller got its connection',
    );
  } finally {
    release();
    metrics.stopPoolSampling();
    await pool.end();
  }
});

test('the time callers wait for a connection of a node pool is counted between scrapes', async () => {
  // The node's own pg pools (main, leader) are counted as the share is: a pool of one connection,
  // held by a transaction, and queries queued behind it for a while between two scrapes.
  const pool = new pg.Pool({ connectionString: db.url, max: 1 });
  const metrics = createMetrics('pool-wait-test');
  metrics.trackPool('leader', poolStats(pool, 1));
  const client = await pool.connect();
  let held = true;
  try {
    const before = parseMetrics(await metrics.registry.metrics());
    assert.equal(before.value('helios_db_pool_saturated_seconds_total', { pool: 'leader' }), 0);
    const queued = [pool.query('SELECT 1'), pool.query('SELECT 2')];
    await sleep(500);
    client.release();
    held = false;
    await Promise.all(queued);
    const after = parseMetrics(await metrics.registry.metrics());
    assert.equal(after.value('helios_db_pool_waiting', { pool: 'leader' }), 0, 'nobody waits at the scrape');
    const waited = after.value('helios_db_pool_saturated_seconds_total', { pool: 'leader' })!;
    assert.ok(waited >= 0.3 && waited <= 1, `counted ${waited} s of waiting, expected about 0.5`);
  } finally {
    if (held) client.release();
    metrics.stopPoolSampling();
    await pool.end();
  }
});
