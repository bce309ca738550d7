// test-runner: alone (stops and starts the shared servers)
import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { pino } from 'pino';
import { createKafka, deleteTopics } from '../../src/broker/index.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { listNodes } from '../../src/coordination/registry.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { insertJob, nextWholeSecond, runsOf, stopJobs, TargetServer, waitFor } from '../support/execution.js';
import { infra, spawnNode, stopAll, type ManagedProcess } from '../support/processes.js';

// A node must start while Kafka or etcd is down and pick the missing server up when it returns.
// These tests stop the shared servers (this worktree's own, by the ports in the environment) and
// restart them in `finally`, whatever happened.

const quiet = pino({ level: 'silent' });
const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const target = new TargetServer();
const nodes: ManagedProcess[] = [];
const prefixes = new Map<string, string>(); // node name → its etcd prefix
// One topic for every node of the file, as in a real cluster: the leader's relay publishes every
// node's outbox rows, and a row for a topic nobody created would hold its batch for ever.
const topic = `helios.test.${uniqueId()}`;
let db: TestDatabase;

before(async () => {
  db = await createTestDatabase();
  await target.start();
});
after(async () => {
  await infra('up', 'etcd');
  await restartKafka(); // leave every server running for the next file
  await stopAll(nodes);
  await target.close();
  await db.drop();
  for (const prefix of prefixes.values()) await etcd.delete().prefix(prefix);
  etcd.close();
  // Every partition left behind makes the next Kafka restart slower (the tests restart it).
  const kafka = createKafka({
    brokers: serverEnv().kafkaBrokers.split(','),
    clientId: 'cleanup',
    logger: quiet,
  });
  await deleteTopics(kafka, [topic, `${topic}.dlq`]).catch(() => undefined);
});

/**
 * `infra.sh up kafka`, waiting a second time if the first wait ran out: a broker reloading many
 * partitions on a loaded machine can take longer than infra.sh's 60 s (it keeps starting).
 */
async function restartKafka(): Promise<void> {
  await infra('up', 'kafka').catch(() => infra('up', 'kafka'));
}

function startNode(name: string): ManagedProcess {
  const prefix = `/helios-test/${uniqueId()}`;
  prefixes.set(name, prefix);
  const node = spawnNode(name, {
    databaseUrl: db.url,
    etcdPrefix: prefix,
    topic,
    // The polling fallback takes a run 500 ms overdue, so a run executes soon without Kafka.
    extra: { HELIOS_ROLES: 'scheduler,worker,api', HELIOS_POLL_OVERDUE_MS: '500' },
  });
  nodes.push(node);
  return node;
}

interface Readiness {
  status: string;
  failing: string[];
  degraded: string[];
}

async function readyz(url: string): Promise<{ code: number; body: Readiness }> {
  const response = await fetch(`${url}/readyz`);
  return { code: response.status, body: (await response.json()) as Readiness };
}

/** Sum of `helios_run_claims_total` samples with these labels on one node. */
async function claims(url: string, source: 'kafka' | 'poll'): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  let sum = 0;
  for (const line of text.split('\n')) {
    if (line.startsWith('helios_run_claims_total{') && line.includes(`source="${source}",result="claimed"`))
      sum += Number(line.split(' ').at(-1));
  }
  return sum;
}

/** SIGTERM while a server is still down: the node exits 0 within a few seconds, every part stopped. */
async function stopsCleanly(node: ManagedProcess): Promise<void> {
  const stopAt = Date.now();
  node.signal('SIGTERM');
  const exit = await node.exited;
  assert.equal(exit.code, 0, node.stderr.join('\n'));
  assert.ok(Date.now() - stopAt < 6000, `shutdown took ${Date.now() - stopAt} ms`);
  const unclean = node.logs.filter((l) => l.msg === 'part did not stop cleanly');
  assert.deepEqual(unclean, [], 'every part stopped cleanly');
}

async function everySecondJob(name: string): Promise<string> {
  return insertJob(db.pool, {
    name: `${name}-${uniqueId()}`,
    schedule: '* * * * * *',
    target: { url: `${target.url}/${name}` },
    nextRunAt: await nextWholeSecond(db.pool, 500),
  });
}

async function succeeded(jobId: string): Promise<number> {
  return (await runsOf(db.pool, jobId)).filter((r) => r.state === 'succeeded').length;
}

test(
  'with Kafka stopped a node starts, runs a job through the polling fallback and names kafka as degraded; when Kafka returns announcements flow again',
  { timeout: 300_000 },
  async () => {
    await infra('down', 'kafka');
    let jobId: string | undefined;
    let node: ManagedProcess;
    let apiUrl: string;
    try {
      node = startNode('kafka-down-1');
      const started = await node.waitForLog((l) => l.msg === 'node started', 30_000);
      apiUrl = String(started.apiUrl);
      await node.waitForLog((l) => l.msg === 'became leader', 15_000);

      const ready = await readyz(apiUrl);
      assert.equal(ready.code, 200, 'a worker still executes: the node stays in service');
      assert.equal(ready.body.status, 'degraded');
      assert.deepEqual(ready.body.failing, ['kafka']);
      assert.deepEqual(ready.body.degraded, ['kafka']);

      jobId = await everySecondJob('kafka-down');
      await waitFor('runs executed without Kafka', async () => (await succeeded(jobId!)) >= 2, 20_000, 200);
      assert.ok((await claims(apiUrl, 'poll')) >= 2, 'claimed by the polling fallback');
      assert.equal(await claims(apiUrl, 'kafka'), 0, 'nothing came through Kafka');
      const pending = await db.pool.query<{ n: number }>(
        'SELECT count(*)::int AS n FROM outbox WHERE published_at IS NULL',
      );
      assert.ok(pending.rows[0]!.n >= 2, 'announcements wait in the outbox');

      // A second node, started and stopped while Kafka is still away, stops cleanly.
      const other = startNode('kafka-down-2');
      await other.waitForLog((l) => l.msg === 'node started', 30_000);
      await sleep(1000); // its background retries are under way
      await stopsCleanly(other);
    } finally {
      await restartKafka();
    }
    // On failure, what the node said about Kafka is the first thing to read.
    const kafkaWarnings = () =>
      JSON.stringify(node.logs.filter((l) => (l.level ?? 0) >= 40).slice(-15), null, 1);
    await node.waitForLog((l) => l.msg === 'Kafka topics ready', 60_000);
    await node.waitForLog((l) => l.msg === 'joined consumer group', 60_000);
    await waitFor(
      'runs claimed from Kafka announcements',
      async () => (await claims(apiUrl, 'kafka')) >= 2,
      30_000,
      250,
    );
    await waitFor(
      'the outbox backlog to be published',
      async () =>
        (
          await db.pool.query<{ n: number }>(
            // Rows of runs created ahead are due at once; "due a second ago" leaves the newest.
            `SELECT count(*)::int AS n FROM outbox
             WHERE published_at IS NULL AND publish_after < now() - interval '1 second'`,
          )
        ).rows[0]!.n === 0,
      60_000,
      250,
    ).catch(async (err: unknown) => {
      const { rows } = await db.pool.query(
        'SELECT topic, count(*)::int AS n FROM outbox WHERE published_at IS NULL GROUP BY topic',
      );
      throw new Error(
        `${String(err)}; pending: ${JSON.stringify(rows)}; the node's last warnings: ${kafkaWarnings()}`,
      );
    });
    await waitFor(
      'readiness to be ready again',
      async () => (await readyz(apiUrl)).body.status === 'ready',
      15_000,
      250,
    );
    await stopJobs(db.pool, [jobId!]);
    await node.stop();
    assert.equal((await node.exited).code, 0, node.stderr.join('\n'));
  },
);

test(
  'with etcd stopped a node starts and its API answers without a leader; when etcd returns it registers, campaigns and dispatches',
  { timeout: 180_000 },
  async () => {
    await infra('down', 'etcd');
    let node: ManagedProcess;
    let apiUrl: string;
    let jobId: string;
    try {
      node = startNode('etcd-down-1');
      const started = await node.waitForLog((l) => l.msg === 'node started', 30_000);
      apiUrl = String(started.apiUrl);
      // Topics are ensured in the background; until then readiness names kafka too.
      await node.waitForLog((l) => l.msg === 'Kafka topics ready', 30_000);

      const ready = await readyz(apiUrl);
      assert.equal(ready.code, 200);
      assert.equal(ready.body.status, 'degraded');
      assert.deepEqual(ready.body.failing, ['etcd']);
      const jobs = await fetch(`${apiUrl}/api/v1/jobs`);
      assert.equal(jobs.status, 200, 'the API answers from PostgreSQL');

      jobId = await everySecondJob('etcd-down');
      await sleep(3000);
      assert.equal(
        node.hasLog((l) => l.msg === 'became leader'),
        false,
        'no leader without etcd',
      );
      assert.deepEqual(await runsOf(db.pool, jobId), [], 'nothing is dispatched without a leader');

      const other = startNode('etcd-down-2');
      await other.waitForLog((l) => l.msg === 'node started', 30_000);
      await sleep(1000);
      await stopsCleanly(other);
    } finally {
      await infra('up', 'etcd');
    }
    await node.waitForLog((l) => l.msg === 'became leader', 30_000);
    await waitFor('the job to run once etcd is back', async () => (await succeeded(jobId)) >= 1, 20_000, 200);
    await waitFor(
      'the node to register',
      async () => (await listNodes(etcd, prefixes.get('etcd-down-1')!)).some((n) => n.id === 'etcd-down-1'),
      15_000,
      250,
    );
    await waitFor(
      'readiness to be ready again',
      async () => (await readyz(apiUrl)).body.status === 'ready',
      15_000,
      250,
    );
    await stopJobs(db.pool, [jobId]);
    await node.stop();
    assert.equal((await node.exited).code, 0, node.stderr.join('\n'));
  },
);
