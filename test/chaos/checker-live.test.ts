// test-runner: alone (its chaos cluster may restart the shared PostgreSQL and Kafka to add listeners)
/**
 * The chaos checker against the running system, not crafted data: the same scenario twice on
 * real PostgreSQL, etcd and Kafka with two real nodes, once with the product intact (the checker
 * must report nothing) and once with the database-side fence check disabled by a trigger in this
 * test's own database (the checker must report the stale leader's write). Product code is
 * untouched; the only hook is the test fixture's IPC gate that holds a leader write
 * (test/fixtures/hooked-node.ts), the one the chaos run's pause-leader fault uses.
 *
 * The scenario: leader A (scheduler only) has its next dispatch write held after its leadership
 * check, then is frozen (SIGSTOP) past its lease. B (every role) becomes leader and creates runs;
 * then B's next write is held too, so occurrences come due that nobody has dispatched. A runs
 * again and its held write goes to PostgreSQL. The fence must reject it (B has written with a
 * newer token); without the fence it creates those runs under A's old epoch, after B's.
 */
import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, test } from 'node:test';
import { createKafka, deleteTopics } from '../../src/broker/index.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createTestDatabase } from '../support/database.js';
import { serverEnv, uniqueId } from '../support/env.js';
import { TargetServer, waitFor } from '../support/execution.js';
import {
  nodeEnvironment,
  spawnFixture,
  stopAll,
  type ManagedProcess,
  type NodeEnv,
} from '../support/processes.js';
import { ChaosApi } from './api-client.js';
import { closeWindow, judgeRun, settle } from './checker.js';
import { holdNextWrite, releaseWrite } from './cluster.js';
import type { FaultRecord } from './faults.js';
import type { Findings } from './observations.js';
import { Nemesis } from './operations.js';
import { seededRandom } from './random.js';
import { CLAIM_GRACE_MS, CLAIM_LEAD_MS, chaosSettings } from './settings.js';
import { initialJobs, targetBehaviour } from './workload.js';

const servers = serverEnv();
const etcd = createEtcdClient(servers.etcdEndpoints.split(','));
const kafka = createKafka({
  brokers: servers.kafkaBrokers.split(','),
  clientId: 'checker-live',
  logger: silentLogger,
});
after(() => etcd.close());

/**
 * Test only: disables the fence check. A BEFORE UPDATE trigger keeps the stored token at 0, so the
 * fence's `WHERE token <= $1` (store/fence.ts) holds for every leader, however stale. No parameters.
 */
const DISABLE_FENCE = `
  CREATE FUNCTION checker_live_fence_off() RETURNS trigger LANGUAGE plpgsql AS $$
  BEGIN
    NEW.token := 0;
    RETURN NEW;
  END $$;
  CREATE TRIGGER checker_live_fence_off BEFORE UPDATE ON leader_fence
    FOR EACH ROW EXECUTE FUNCTION checker_live_fence_off()`;

/** The nodes' HELIOS_DISPATCH_LOOKAHEAD_MS here (see pausedLeaderScenario). */
const LOOKAHEAD_MS = 5000;

/** Runs created under one epoch. $1 = token. */
const RUNS_OF_EPOCH = 'SELECT count(*)::int AS n FROM runs WHERE created_epoch = $1';

function hookedNode(name: string, env: NodeEnv, processes: ManagedProcess[]): ManagedProcess {
  const node = spawnFixture(name, 'test/fixtures/hooked-node.ts', nodeEnvironment(name, env));
  processes.push(node);
  return node;
}

/** Runs the scenario on a fresh database, etcd prefix and topic; returns what the chaos checker found. */
async function pausedLeaderScenario(fence: 'intact' | 'disabled'): Promise<Findings> {
  const db = await createTestDatabase();
  const env: NodeEnv = {
    databaseUrl: db.url,
    etcdPrefix: `/helios-test/${uniqueId()}`,
    topic: `helios.test.${uniqueId()}`,
    extra: {
      HELIOS_CLAIM_GRACE_MS: String(CLAIM_GRACE_MS),
      HELIOS_CLAIM_LEAD_MS: String(CLAIM_LEAD_MS),
      // The lookahead this scenario was written with. With the default 5.5 s, A's write after its
      // resume created no run in 2 of 2 runs (2026-12-06), so the disabled fence had nothing to let
      // through and the checker nothing to find; why was not found.
      HELIOS_DISPATCH_LOOKAHEAD_MS: String(LOOKAHEAD_MS),
    },
  };
  const target = new TargetServer(targetBehaviour(new Set()));
  const processes: ManagedProcess[] = [];
  try {
    if (fence === 'disabled') await db.pool.query(DISABLE_FENCE);
    const targetUrl = await target.start();
    // A holds no claims, so freezing it strands no call: every redelivery would be unexplained.
    const a = hookedNode('live-a', { ...env, extra: { ...env.extra, HELIOS_ROLES: 'scheduler' } }, processes);
    const aLead = await a.waitForLog((l) => l.msg === 'became leader', 60_000);
    const b = hookedNode('live-b', env, processes);
    const apiUrl = (await b.waitForLog((l) => l.msg === 'node started', 60_000)).apiUrl as string;
    await b.waitForLog((l) => l.msg === 'joined consumer group', 60_000);

    // Jobs through the API, so the reference model starts from its answers (open mode: no token).
    const nemesis = new Nemesis(
      new ChaosApi(() => [apiUrl], seededRandom(1), undefined),
      seededRandom(2),
      targetUrl,
      new Set(),
    );
    for (const plan of initialJobs(3, 0).filter((p) => p.role === 'steady')) await nemesis.create(plan);
    const windowStart = Math.ceil(Date.now() / 1000) * 1000;
    await waitFor(
      'runs from leader A',
      async () => (await db.pool.query<{ n: number }>(RUNS_OF_EPOCH, [aLead.token])).rows[0]!.n > 0,
      20_000,
    );

    assert.ok(await holdNextWrite(a, 5000), 'leader A made no dispatch write to hold');
    const start = Date.now();
    a.signal('SIGSTOP');
    const fault: FaultRecord = {
      kind: 'pause-leader',
      node: a.name,
      start,
      end: start,
      haltedAt: start,
      heldWrite: true,
    };
    const bLead = await b.waitForLog((l) => l.msg === 'became leader', 30_000);
    await waitFor(
      'runs from leader B',
      async () => (await db.pool.query<{ n: number }>(RUNS_OF_EPOCH, [bLead.token])).rows[0]!.n > 0,
      20_000,
    );
    assert.ok(await holdNextWrite(b, 5000), 'leader B made no dispatch write to hold');
    // B's last pass created runs up to its lookahead; 2 s later more jobs are due within A's.
    await sleep(2000);
    const runsOfA = async () => (await db.pool.query<{ n: number }>(RUNS_OF_EPOCH, [aLead.token])).rows[0]!.n;
    const before = await runsOfA();
    a.signal('SIGCONT');
    releaseWrite(a);
    fault.end = Date.now();
    // B stays held until A's write has ended, rejected or committed, or B's next pass would take
    // the due occurrences first and A's write, fenced or not, would find nothing to do.
    await waitFor(
      "the end of A's held write",
      async () =>
        a.hasLog((l) => String(l.msg).includes('rejected by the fence')) || (await runsOfA()) > before,
      15_000,
    );
    await a.waitForLog((l) => l.msg === 'stepped down', 20_000);
    releaseWrite(b);
    await sleep(3000);

    const jobIds = nemesis.jobs.map((j) => j.id);
    const windowEnd = await closeWindow(db.pool, jobIds);
    await settle(db.pool, 30_000);
    return judgeRun(db.pool, env.topic, {
      windowStart,
      windowEnd,
      jobs: nemesis.jobs,
      requests: target.requests,
      faults: [fault],
      processes,
      ops: nemesis.ops,
      settings: { ...chaosSettings(4000), lookaheadMs: LOOKAHEAD_MS },
    });
  } finally {
    await stopAll(processes);
    await target.close();
    await etcd.delete().prefix(env.etcdPrefix);
    await deleteTopics(kafka, [env.topic, `${env.topic}.dlq`]).catch(() => undefined);
    await db.drop();
  }
}

test('control: a paused leader against the intact product, the chaos checker reports no violation', async (t) => {
  const found = await pausedLeaderScenario('intact');
  t.diagnostic(found.lines.filter((l) => /epoch|fence|judged/.test(l)).join('\n'));
  assert.deepEqual(found.violations, [], found.lines.join('\n'));
  assert.ok(
    found.lines.some((l) => l.includes('rejected by the fence after resume: yes')),
    found.lines.join('\n'),
  );
});

test('fence check disabled: the chaos checker reports the stale leader’s write', async (t) => {
  const found = await pausedLeaderScenario('disabled');
  t.diagnostic(found.violations.join('\n'));
  const text = found.violations.join('\n');
  assert.match(text, /epoch \d+ created a run at \S+, after epoch \d+ had created one/, text);
  assert.match(
    text,
    /live-a was paused with a write held and, after its resume .* logged no fence rejection/,
    text,
  );
});
