/**
 * Chaos test: 3 real nodes on the real servers, jobs made through the REST API (steady
 * every-second jobs with misfire fire-once, skip and fire-all/maxCatchUp 2; jobs the operations
 * work on; failing jobs that go dead; a forbid and a replace job whose calls take about a
 * period), a recording HTTP target, a seeded schedule of faults, each followed by recovery
 * (kill -9 of the leader, SIGSTOP of the leader for 2×TTL, kill -9 of a worker mid-call,
 * restarts of Kafka, PostgreSQL and etcd, partitions of one node from etcd, PostgreSQL, Kafka or
 * everything in its own network namespace, faults of the 3-member etcd cluster, and in long runs
 * outages of 30-120 s: see faults.ts), and meanwhile
 * a seeded stream of API operations (create, PATCH, pause, resume, delete, trigger, replay).
 * Then the checker compares every run with the reference model built from the API's answers,
 * prints a table, and exits 1 on any violation.
 *
 *   npm run chaos -- --duration 60 --seed 1 [--steady 9] [--ops 5]
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { setTimeout as sleep } from 'node:timers/promises';
import { createKafka, deleteTopics } from '../../src/broker/index.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createTestDatabase } from '../support/database.js';
import { REPO_ROOT, serverEnv, uniqueId } from '../support/env.js';
import { TargetServer } from '../support/execution.js';
import { infra } from '../support/processes.js';
import { ChaosApi } from './api-client.js';
import { ChaosCluster } from './cluster.js';
import { closeWindow, judgeRun, readRunsBeforeDelete, settle, unknownJobs } from './checker.js';
import { injectFault, planFaults, type FaultRecord } from './faults.js';
import type { RunRow } from './observations.js';
import { Nemesis, OP_KINDS } from './operations.js';
import { seededRandom } from './random.js';
import { CLAIM_GRACE_MS, CLAIM_LEAD_MS, TTL_MS, chaosSettings } from './settings.js';
import { initialJobs, targetBehaviour } from './workload.js';

const { values } = parseArgs({
  options: {
    duration: { type: 'string', default: '60' },
    seed: { type: 'string', default: String(Date.now() % 1_000_000) },
    steady: { type: 'string', default: '9' },
    ops: { type: 'string', default: '5' },
    settle: { type: 'string', default: '4000' },
  },
});
const durationMs = Number(values.duration) * 1000;
const seed = Number(values.seed);
const settleMs = Number(values.settle);
const log = (message: string) => console.log(`[chaos ${new Date().toISOString().slice(11, 23)}] ${message}`);

const SETTINGS = chaosSettings(settleMs);

const random = seededRandom(seed);
const opsRandom = seededRandom(seed * 7919 + 1);
log(`seed ${seed}, fault phase ${durationMs / 1000} s`);

await infra('up');
const servers = serverEnv();
const db = await createTestDatabase();
const env = {
  databaseUrl: db.url,
  etcdPrefix: `/helios-chaos/${uniqueId()}`,
  topic: `helios.chaos.${uniqueId()}`,
  extra: {
    HELIOS_LOG_LEVEL: 'info',
    HELIOS_CLAIM_GRACE_MS: String(CLAIM_GRACE_MS),
    HELIOS_CLAIM_LEAD_MS: String(CLAIM_LEAD_MS),
    HELIOS_SHUTDOWN_TIMEOUT_MS: '3000',
    // The checker reads every outbox row back against the topic; the leader's pruner would delete
    // published rows after the default 10 minutes, and a long run's first rows would then look
    // like messages nobody announced.
    HELIOS_OUTBOX_RETENTION: '6h',
  },
};
const healed = new Set<string>();
const target = new TargetServer(targetBehaviour(healed));
// --- netns/etcd cluster: network namespaces, a 3-member etcd cluster, the fault plan.
const cluster = await ChaosCluster.create(env, ['chaos-a', 'chaos-b', 'chaos-c'], log).catch(async (err) => {
  await db.drop(); // the run has not started: nothing else to clean
  throw err;
});
// Every required kind once, in a seeded order; more random faults while time is left.
const { required: schedule, available } = planFaults(durationMs, cluster.network !== null, random);
log(`faults planned: ${schedule.join(' ')}`);
// --- end netns/etcd cluster
const faults: FaultRecord[] = [];
let exitCode = 1;

/** API URLs of the nodes alive now (every chaos node has the api role). */
function apiUrls(): string[] {
  return [...cluster.live.entries()].filter(([, p]) => p.running).map(([name]) => cluster.apiUrl(name));
}

try {
  const targetUrl = await target.start(cluster.targetHost);
  await cluster.start();
  log(`nodes up; leader ${(await cluster.leader()).name}`);
  // A delete takes the job's runs with it: they are read first, for the checker.
  const runsOfDeletedJobs: RunRow[] = [];
  const nemesis = new Nemesis(
    new ChaosApi(apiUrls, opsRandom, cluster.apiToken),
    opsRandom,
    targetUrl,
    healed,
    async (jobId) => void runsOfDeletedJobs.push(...(await readRunsBeforeDelete(db.pool, jobId))),
  );
  for (const plan of initialJobs(Number(values.steady), Number(values.ops))) await nemesis.create(plan);
  const windowStart = Math.ceil(Date.now() / 1000) * 1000 + 2000;
  log(`${nemesis.jobs.length} jobs made through the API; window from ${new Date(windowStart).toISOString()}`);
  await sleep(3000);

  const phaseEnd = Date.now() + durationMs;
  const stopOps = new AbortController();
  // Operations go on until the last fault has recovered, so every fault meets some.
  const operations = nemesis.run(Infinity, stopOps.signal);
  for (let i = 0; Date.now() < phaseEnd || i < schedule.length; i++) {
    const kind = schedule[i] ?? available[Math.floor(random() * available.length)]!;
    log(`fault ${i + 1}: ${kind}`);
    const record = await injectFault(kind, { cluster, pool: db.pool, ttlMs: TTL_MS, log });
    faults.push(record);
    log(
      `  ${record.node ?? ''} recovered after ${record.end - record.start} ms${record.note ? ` (${record.note})` : ''}`,
    );
    await sleep(settleMs);
  }
  stopOps.abort();
  await operations;
  const jobIds = nemesis.jobs.map((j) => j.id);
  // Jobs no answer named (a create that took effect late) stop with the others: one left running
  // announces runs after the checker has read the outbox (seed 93), and the checker judges them.
  const unknown = await unknownJobs(db.pool, jobIds);
  if (unknown.length > 0)
    log(`jobs the API never named: ${unknown.map((j) => `${j.name} ${j.id}`).join(', ')}`);

  const windowEnd = await closeWindow(db.pool, [...jobIds, ...unknown.map((j) => j.id)]);
  log('faults and operations done; scheduling stopped; settling');
  await settle(db.pool, 60_000);

  const findings = await judgeRun(db.pool, env.topic, {
    windowStart,
    windowEnd,
    jobs: nemesis.jobs,
    requests: target.requests,
    faults,
    processes: cluster.history,
    ops: nemesis.ops,
    unknownJobs: unknown,
    settings: SETTINGS,
    runsOfDeletedJobs,
  });
  const violations = [...findings.violations];
  for (const kind of OP_KINDS)
    if (!nemesis.ops.some((o) => o.kind === kind && o.outcome === 'ok'))
      violations.push(`no ${kind} operation succeeded: the run did not exercise it`);

  console.log('\nfaults:');
  for (const f of faults) {
    console.log(
      `  ${f.kind.padEnd(22)} ${(f.node ?? '').padEnd(8)} at +${((f.start - windowStart) / 1000).toFixed(1)} s, ` +
        `recovered in ${f.end - f.start} ms${f.kind === 'pause-leader' ? ` (write held: ${f.heldWrite})` : ''}`,
    );
  }
  console.log('\noperations (kind: ok/refused/unknown):');
  for (const kind of OP_KINDS) {
    const of = nemesis.ops.filter((o) => o.kind === kind);
    const n = (outcome: string) => of.filter((o) => o.outcome === outcome).length;
    console.log(`  ${kind.padEnd(16)} ${n('ok')}/${n('refused')}/${n('unknown')}`);
  }
  console.log(`\nwindow ${new Date(windowStart).toISOString()} … ${new Date(windowEnd).toISOString()}`);
  for (const line of findings.lines) console.log(line);
  // Every node's log, the operations and the requests, for the post-mortem of a failed run.
  const logDir = `${REPO_ROOT}.helios/chaos-logs/${seed}-${uniqueId()}`;
  mkdirSync(logDir, { recursive: true });
  cluster.history.forEach((p, i) =>
    writeFileSync(
      `${logDir}/${i}-${p.name}.jsonl`,
      [
        ...p.logs.map((l) => JSON.stringify(l)),
        ...p.stderr.map((line) => JSON.stringify({ stderr: line })),
      ].join('\n') + '\n',
    ),
  );
  writeFileSync(
    `${logDir}/operations.json`,
    JSON.stringify({ ops: nemesis.ops, jobs: nemesis.jobs, unknownJobs: unknown, faults }, null, 1),
  );
  writeFileSync(
    `${logDir}/database.json`,
    JSON.stringify(findings.database, (_key, value: unknown) =>
      typeof value === 'bigint' ? value.toString() : value,
    ),
  );
  writeFileSync(
    `${logDir}/deliveries.jsonl`,
    findings.deliveries.map((d) => JSON.stringify(d)).join('\n') + '\n',
  );
  console.log(`node logs, operations and deliveries: ${logDir}`);
  if (violations.length === 0) {
    console.log(`\nchaos: no violation (seed ${seed})`);
    exitCode = 0;
  } else {
    console.log(`\nchaos: VIOLATIONS (seed ${seed}):`);
    for (const v of violations) console.log(`  - ${v}`);
  }
} catch (err) {
  console.error('chaos run failed:', err);
} finally {
  await cluster.stop();
  await target.close();
  await infra('up'); // whatever the last fault did, leave the servers running
  const kafka = createKafka({
    brokers: servers.kafkaBrokers.split(','),
    clientId: 'chaos-cleanup',
    logger: silentLogger,
  });
  await deleteTopics(kafka, [env.topic, `${env.topic}.dlq`]).catch(() => undefined);
  await db.drop();
}
process.exit(exitCode);
