/**
 * Chaos test: 3 real nodes on the real servers, K every-second jobs (misfire fire-all) calling a
 * recording HTTP target, and a seeded schedule of faults, each followed by recovery: kill -9 of
 * the leader, SIGSTOP of the leader for 2×TTL, kill -9 of a worker mid-call, restarts of Kafka,
 * PostgreSQL and etcd, and cutting the leader off from etcd alone. Then a checker compares what
 * should have happened with what did, prints a table, and exits 1 on any violation.
 *
 *   npm run chaos -- --duration 75 --seed 1 [--jobs 20]
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { setTimeout as sleep } from 'node:timers/promises';
import { createKafka, deleteTopics } from '../../src/broker/index.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createTestDatabase } from '../support/database.js';
import { REPO_ROOT, serverEnv, uniqueId } from '../support/env.js';
import { TargetServer, insertJob } from '../support/execution.js';
import { infra } from '../support/processes.js';
import { ChaosCluster } from './cluster.js';
import { check } from './checker.js';
import { injectFault, planFaults, type FaultRecord } from './faults.js';
import { seededRandom } from './random.js';

const { values } = parseArgs({
  options: {
    duration: { type: 'string', default: '75' },
    seed: { type: 'string', default: String(Date.now() % 1_000_000) },
    jobs: { type: 'string', default: '20' },
    settle: { type: 'string', default: '4000' },
  },
});
const durationMs = Number(values.duration) * 1000;
const seed = Number(values.seed);
const jobCount = Number(values.jobs);
const settleMs = Number(values.settle);
const TTL_MS = 3000;
const log = (message: string) => console.log(`[chaos ${new Date().toISOString().slice(11, 23)}] ${message}`);

const random = seededRandom(seed);
log(`seed ${seed}, fault phase ${durationMs / 1000} s, ${jobCount} every-second jobs`);

await infra('up');
const servers = serverEnv();
const db = await createTestDatabase();
const env = {
  databaseUrl: db.url,
  etcdPrefix: `/helios-chaos/${uniqueId()}`,
  topic: `helios.chaos.${uniqueId()}`,
  extra: { HELIOS_LOG_LEVEL: 'info', HELIOS_CLAIM_GRACE_MS: '3000', HELIOS_SHUTDOWN_TIMEOUT_MS: '3000' },
};
const target = new TargetServer(() => ({ status: 200, delayMs: 50 + Math.floor(Math.random() * 250) }));
// --- netns/etcd cluster (wt-netns): network namespaces, a 3-member etcd cluster, the fault plan.
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

try {
  const targetUrl = await target.start(cluster.targetHost);
  await cluster.start();
  log(`nodes up; leader ${(await cluster.leader()).name}`);

  const { rows } = await db.pool.query<{ start: Date }>(
    `SELECT date_trunc('second', now()) + interval '2 seconds' AS start`,
  );
  const windowStart = rows[0]!.start;
  const jobIds: string[] = [];
  for (let i = 0; i < jobCount; i++) {
    jobIds.push(
      await insertJob(db.pool, {
        name: `chaos-${i}`,
        schedule: '* * * * * *',
        target: { url: `${targetUrl}/job/${i}`, method: 'POST', body: { i } },
        nextRunAt: windowStart,
        timeoutMs: 5000,
        maxAttempts: 10,
        backoffMs: 200,
      }),
    );
  }
  await db.pool.query(
    `UPDATE jobs SET misfire = 'fire-all', max_catch_up = 1000 WHERE id = ANY($1::uuid[])`,
    [jobIds],
  );
  await sleep(3000);

  const phaseEnd = Date.now() + durationMs;
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

  // Close the window once the dispatcher has passed its end, then stop scheduling and settle.
  const windowEnd = new Date(Math.floor(Date.now() / 1000) * 1000 - 1000);
  for (let waited = 0; ; waited += 200) {
    const { rows: behind } = await db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM jobs WHERE id = ANY($1::uuid[]) AND next_run_at <= $2`,
      [jobIds, windowEnd],
    );
    if (behind[0]!.n === 0) break;
    if (waited > 30_000) throw new Error('the dispatcher did not catch up within 30 s');
    await sleep(200);
  }
  await db.pool.query(`UPDATE jobs SET enabled = false WHERE id = ANY($1::uuid[])`, [jobIds]);
  log('faults done; scheduling stopped; settling');
  for (let waited = 0; waited < 60_000; waited += 500) {
    const { rows: active } = await db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM runs WHERE state IN ('queued', 'running')`,
    );
    if (active[0]!.n === 0) break;
    await sleep(500);
  }

  const result = await check({
    pool: db.pool,
    jobIds,
    windowStart,
    windowEnd,
    requests: target.requests,
    faults,
    processes: cluster.history,
    settleMs,
  });
  console.log('\nfaults:');
  for (const f of faults) {
    console.log(
      `  ${f.kind.padEnd(22)} ${(f.node ?? '').padEnd(8)} at +${((f.start - windowStart.getTime()) / 1000).toFixed(1)} s, ` +
        `recovered in ${f.end - f.start} ms${f.kind === 'pause-leader' ? ` (write held: ${f.heldWrite})` : ''}`,
    );
  }
  console.log(`\nwindow ${windowStart.toISOString()} … ${windowEnd.toISOString()}`);
  for (const line of result.lines) console.log(line);
  // Every node's log, for the post-mortem of a failed run.
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
  console.log(`node logs: ${logDir}`);
  if (result.violations.length === 0) {
    console.log(`\nchaos: no violation (seed ${seed})`);
    exitCode = 0;
  } else {
    console.log(`\nchaos: ${result.violations.length} VIOLATIONS (seed ${seed}):`);
    for (const v of result.violations) console.log(`  - ${v}`);
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
