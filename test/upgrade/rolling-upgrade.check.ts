/**
 * A rolling upgrade from the previous release (docs/operations.md, "Upgrade: a rolling restart"):
 * the database migrated by this checkout's migrations, then a cluster in which nodes of the
 * previous release and of this checkout run together against the same PostgreSQL, etcd prefix and
 * Kafka topics, under every-second jobs and the operations nemesis's API calls (pause, resume,
 * PATCH, trigger, replay, create, delete) sent to old and new nodes alike. The chaos checker
 * judges it: every occurrence due ran once, with one call.
 *
 * The database starts empty: the old nodes migrate it to their schema at boot, and this checkout's
 * `helios migrate` runs while they work. The old release (test/support/old-release.ts): the commit before the newest migration was
 * added, built from this checkout's history with its node_modules; HELIOS_MIXED_OLD names another
 * commit, HELIOS_MIXED_OLD_DIR an old checkout already built. A clone without that history (a
 * shallow one) skips.
 *
 * One node at a time, as the procedure says. Node b has the worker and api roles only, in both
 * versions, so which node leads after the old leader stops is known. HELIOS_MIXED_ORDER:
 * - `leader-second` (default): old-a leads, old-b, old-c; c restarted new (2 old + 1 new, the old
 *   leader dispatching to old and new workers); a restarted new (new-c leads beside old-b, then
 *   new-a joins: 1 old + 2 new, a new leader with an old worker); b restarted new.
 * - `leader-last`: c restarted new, then b (1 old + 2 new, the old leader the only old node),
 *   then a (new-c leads).
 * The test also checks that the versions did mix: new workers called runs an old leader made
 * and, in the first order, an old worker runs a new leader made.
 *
 * Not in `npm test` (a minute, and the suite is kept under 20): CI runs it after the chaos run
 * (`npm run test:upgrade`), as scripts/mixed-versions.sh does for other releases.
 */
import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, test } from 'node:test';
import type pg from 'pg';
import { createKafka, deleteTopics } from '../../src/broker/index.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createTestDatabase } from '../support/database.js';
import { REPO_ROOT, serverEnv, uniqueId } from '../support/env.js';
import { oldRelease, spawnNodeOf } from '../support/old-release.js';
import { TargetServer, waitFor } from '../support/execution.js';
import { nodeEnvironment, runCli, stopAll, type ManagedProcess, type NodeEnv } from '../support/processes.js';
import { ChaosApi } from '../chaos/api-client.js';
import { closeWindow, judgeRun, settle } from '../chaos/checker.js';
import type { FaultRecord } from '../chaos/faults.js';
import { Nemesis } from '../chaos/operations.js';
import { seededRandom } from '../chaos/random.js';
import { CLAIM_GRACE_MS, CLAIM_LEAD_MS, chaosSettings } from '../chaos/settings.js';
import { initialJobs, targetBehaviour } from '../chaos/workload.js';

const servers = serverEnv();
const etcd = createEtcdClient(servers.etcdEndpoints.split(','));
const kafka = createKafka({
  brokers: servers.kafkaBrokers.split(','),
  clientId: 'mixed-versions',
  logger: silentLogger,
});
after(() => etcd.close());

const release = oldRelease();
/** When each node process was spawned (ms). */
const startedAt = new Map<ManagedProcess, number>();

test(
  'a rolling upgrade from the previous release: old and new nodes together lose and double no occurrence',
  { timeout: 240_000, skip: typeof release === 'string' ? release : false },
  async (t) => {
    const old = release as Exclude<typeof release, string>;
    const order = process.env.HELIOS_MIXED_ORDER ?? 'leader-second';
    assert.ok(['leader-second', 'leader-last'].includes(order), `HELIOS_MIXED_ORDER ${order}`);
    t.diagnostic(`old release ${old.commit}, order ${order}`);
    // The schema the old release made: its nodes migrate at boot; this checkout's migrations are
    // applied later, under the running old cluster, as step 1 of the procedure says.
    const db = await createTestDatabase({ empty: true });
    const env: NodeEnv = {
      databaseUrl: db.url,
      etcdPrefix: `/helios-test/${uniqueId()}`,
      topic: `helios.test.${uniqueId()}`,
      extra: {
        HELIOS_CLAIM_GRACE_MS: String(CLAIM_GRACE_MS),
        HELIOS_CLAIM_LEAD_MS: String(CLAIM_LEAD_MS),
        HELIOS_SHUTDOWN_TIMEOUT_MS: '3000',
        HELIOS_KAFKA_PARTITIONS: '6',
      },
    };
    const healed = new Set<string>();
    const target = new TargetServer(targetBehaviour(healed));
    const processes: ManagedProcess[] = [];
    const versionOf = new Map<ManagedProcess, 'old' | 'new'>();
    const live = new Map<string, { node: ManagedProcess; apiUrl: string }>();
    const roles: Record<string, string> = { b: 'worker,api' };
    const start = async (name: string, version: 'old' | 'new') => {
      const root = version === 'old' ? old.dir : REPO_ROOT;
      const spawnedAt = Date.now();
      const node = spawnNodeOf(root, name, {
        ...env,
        extra: { ...env.extra, ...(roles[name] ? { HELIOS_ROLES: roles[name] } : {}) },
      });
      processes.push(node);
      versionOf.set(node, version);
      startedAt.set(node, spawnedAt);
      const apiUrl = (await node.waitForLog((l) => l.msg === 'node started', 60_000)).apiUrl as string;
      await node.waitForLog((l) => l.msg === 'joined consumer group', 60_000);
      await waitFor(`${name} ready`, async () => (await fetch(`${apiUrl}/readyz`)).status === 200, 20_000);
      live.set(name, { node, apiUrl });
      return node;
    };
    const faults: FaultRecord[] = [];
    const restart = async (name: string, kind: 'sigterm-leader' | 'sigterm-worker-mid-call') => {
      const { node } = live.get(name)!;
      const at = Date.now();
      live.delete(name);
      node.signal('SIGTERM');
      const { code } = await node.exited;
      assert.equal(code, 0, `${name} exits 0 after SIGTERM`);
      const record: FaultRecord = { kind, node: name, start: at, end: Date.now(), haltedAt: Date.now() };
      await sleep(1000);
      await start(name, 'new');
      record.end = Date.now();
      faults.push(record);
    };
    try {
      const targetUrl = await target.start();
      const a = await start('a', 'old');
      await a.waitForLog((l) => l.msg === 'became leader', 30_000);
      await start('b', 'old');
      await start('c', 'old');
      const random = seededRandom(Number(process.env.HELIOS_MIXED_SEED ?? 7));
      const nemesis = new Nemesis(
        new ChaosApi(() => [...live.values()].map((n) => n.apiUrl), random, undefined),
        random,
        targetUrl,
        healed,
      );
      for (const plan of initialJobs(3, 3)) await nemesis.create(plan);
      const windowStart = Math.ceil(Date.now() / 1000) * 1000 + 1000;
      const stopOps = new AbortController();
      const operations = nemesis.run(Infinity, stopOps.signal);
      await sleep(3000);
      const migrated = await runCli(['migrate'], nodeEnvironment('migrate', env));
      assert.equal(migrated.code, 0, `helios migrate of this checkout: ${migrated.output}`);
      t.diagnostic(`migrated under the old cluster: ${migrated.stdout.trim()}`);
      await sleep(2000);
      await restart('c', 'sigterm-worker-mid-call'); // 2 old (a leads) + 1 new
      await sleep(12_000);
      if (order === 'leader-last') {
        await restart('b', 'sigterm-worker-mid-call'); // 1 old (a leads) + 2 new
        await sleep(12_000);
        await restart('a', 'sigterm-leader'); // new-c leads: all new
      } else {
        await restart('a', 'sigterm-leader'); // new-c leads; old-b works; new-a joins
        await sleep(12_000);
        await restart('b', 'sigterm-worker-mid-call'); // all new
      }
      await sleep(4000);
      stopOps.abort();
      await operations;
      const windowEnd = await closeWindow(
        db.pool,
        nemesis.jobs.map((j) => j.id),
      );
      await settle(db.pool, 30_000);
      const found = await judgeRun(db.pool, env.topic, {
        windowStart,
        windowEnd,
        jobs: nemesis.jobs,
        requests: target.requests,
        faults,
        processes,
        ops: nemesis.ops,
        settings: chaosSettings(4000),
      });
      const mixed = await mixes(db.pool, processes, versionOf);
      t.diagnostic(
        `attempts of runs an old leader made, called by a new worker: ${mixed.oldLeaderNewWorker}; ` +
          `a new leader's, by an old worker: ${mixed.newLeaderOldWorker}`,
      );
      assert.ok(mixed.oldLeaderNewWorker > 0, 'a new worker called runs of the old leader');
      if (order === 'leader-second')
        assert.ok(mixed.newLeaderOldWorker > 0, 'an old worker called runs of the new leader');
      const kinds = [...new Set(nemesis.ops.filter((o) => o.outcome === 'ok').map((o) => o.kind))];
      t.diagnostic(`operations that succeeded: ${kinds.join(' ')}`);
      for (const kind of ['pause', 'resume', 'patch-schedule', 'trigger', 'replay'] as const)
        assert.ok(kinds.includes(kind), `no ${kind} succeeded: the run did not exercise it`);
      t.diagnostic(found.lines.join('\n'));
      assert.deepEqual(found.violations, [], found.violations.join('\n'));
    } finally {
      await stopAll(processes);
      await target.close();
      await etcd.delete().prefix(env.etcdPrefix);
      await deleteTopics(kafka, [env.topic, `${env.topic}.dlq`]).catch(() => undefined);
      await db.drop();
      old.remove();
    }
  },
);

/**
 * How many attempts a worker of one release made of runs a leader of the other release created:
 * the leader by the epoch's token ("became leader" logs it), the worker by the process of that
 * name running when the attempt started.
 */
async function mixes(
  pool: pg.Pool,
  processes: readonly ManagedProcess[],
  versionOf: ReadonlyMap<ManagedProcess, 'old' | 'new'>,
): Promise<{ oldLeaderNewWorker: number; newLeaderOldWorker: number }> {
  const leaderOf = new Map<string, 'old' | 'new'>();
  for (const p of processes)
    for (const line of p.logs)
      if (line.msg === 'became leader') leaderOf.set(String(line.token), versionOf.get(p)!);
  const { rows } = await pool.query<{ node: string; epoch: string; at: Date }>(
    `SELECT a.node_id AS node, r.created_epoch::text AS epoch, a.started_at AS at
     FROM run_attempts a JOIN runs r ON r.id = a.run_id WHERE r.created_epoch IS NOT NULL`,
  );
  const workerAt = (node: string, at: number) => {
    // The latest process of that name started before the attempt (each is started after the last
    // one of its name has exited).
    const of = processes.filter((p) => p.name === node && startedAt.get(p)! <= at);
    return of.length > 0 ? versionOf.get(of[of.length - 1]!) : undefined;
  };
  let oldLeaderNewWorker = 0;
  let newLeaderOldWorker = 0;
  for (const r of rows) {
    const leader = leaderOf.get(r.epoch);
    const worker = workerAt(r.node, r.at.getTime());
    if (leader === 'old' && worker === 'new') oldLeaderNewWorker += 1;
    if (leader === 'new' && worker === 'old') newLeaderOldWorker += 1;
  }
  return { oldLeaderNewWorker, newLeaderOldWorker };
}
