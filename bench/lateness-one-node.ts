// End-to-end lateness of one Helios node: HTTP arrival at the target − scheduled_for.
//
//   npm run build && npx tsx bench/lateness-one-node.ts [jobs=200] [seconds=60] [concurrency=1.25×jobs]
//
// Needs the local servers (`scripts/infra.sh up`). Spawns the built node (`dist/main.js node`,
// all roles) on its own database, Kafka topic and etcd prefix; creates `jobs` jobs with the
// every-second schedule `* * * * * *`; lets them run for `seconds`; prints percentiles of the
// lateness measured at a local HTTP target (same host, so one clock), and where the time went
// (dispatch, claim) from the database.
import { setTimeout as sleep } from 'node:timers/promises';
import { Agent, request } from 'undici';
import { createEtcdClient } from '../src/coordination/etcd.js';
import { createTestDatabase } from '../test/support/database.js';
import { REPO_ROOT, serverEnv, uniqueId } from '../test/support/env.js';
import { nextWholeSecond, percentile, TargetServer } from '../test/support/execution.js';
import { spawnNode } from '../test/support/processes.js';

const JOBS = Number(process.argv[2] ?? 200);
const SECONDS = Number(process.argv[3] ?? 60);
const CONCURRENCY = Number(process.argv[4] ?? Math.max(64, Math.ceil(JOBS * 1.25)));
const WARMUP_S = 3;
const PROFILE_DIR = process.env.BENCH_PROFILE_DIR;

const fmt = (values: number[]) =>
  ['p50', 'p90', 'p99', 'p99.9']
    .map((p) => `${p} ${percentile(values, Number(p.slice(1))).toFixed(1)}`)
    .concat(`max ${Math.max(...values).toFixed(1)}`, `min ${Math.min(...values).toFixed(1)}`)
    .join('  ');

async function main(): Promise<void> {
  const db = await createTestDatabase();
  const target = new TargetServer();
  await target.start();
  const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
  const prefix = `/helios-bench/${uniqueId()}`;
  const topic = `helios.bench.${uniqueId()}`;
  const node = spawnNode('bench-1', {
    databaseUrl: db.url,
    etcdPrefix: prefix,
    topic,
    extra: {
      // BENCH_PROFILE_DIR=/tmp/x: a CPU profile of the node over the measured window.
      ...(PROFILE_DIR
        ? {
            NODE_OPTIONS: `--import ${REPO_ROOT}bench/lib/cpu-profiler.mjs`,
            HELIOS_BENCH_PROFILE_DIR: PROFILE_DIR,
          }
        : {}),
      // Every job fires at the same instant each second: the node needs a slot for each of them
      // (with the default 64 they would fire in waves, which is what the setting is for).
      HELIOS_WORKER_CONCURRENCY: String(CONCURRENCY),
      HELIOS_KAFKA_PARTITIONS: '6',
      HELIOS_SHUTDOWN_TIMEOUT_MS: '5000',
    },
  });
  try {
    await node.waitForLog((l) => l.msg === 'joined consumer group', 60_000);
    const start = await nextWholeSecond(db.pool, 1500);
    await db.pool.query(
      `INSERT INTO jobs (name, schedule, target, next_run_at)
       SELECT 'every-second-' || n, '* * * * * *', $1, $2 FROM generate_series(1, $3) AS n`,
      [{ url: `${target.url}/tick`, method: 'POST', body: { n: 1 } }, start, JOBS],
    );
    const end = start.getTime() + SECONDS * 1000;
    process.stdout.write(`running ${JOBS} every-second jobs for ${SECONDS} s on one node…\n`);
    if (PROFILE_DIR) {
      await sleep(start.getTime() + WARMUP_S * 1000 - Date.now());
      node.signal('SIGUSR2');
    }
    await sleep(end - Date.now() + 100);
    if (PROFILE_DIR) node.signal('SIGUSR2');
    await db.pool.query('UPDATE jobs SET enabled = false');
    await sleep(3000);

    // Skip the first seconds: the node's connections to the target are opened then.
    const from = start.getTime() + WARMUP_S * 1000;
    const measured = target.requests.filter(
      (r) => Date.parse(r.scheduledFor) >= from && Date.parse(r.scheduledFor) < end,
    );
    const lateness = measured.map((r) => r.arrivedAt - Date.parse(r.scheduledFor));
    const { rows } = await db.pool.query<{ created: number; claimed: number; ok: number; total: number }>(
      `SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.scheduled_for - r.created_at) * 1000) AS created,
              percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM a.started_at - r.scheduled_for) * 1000) AS claimed,
              count(*) FILTER (WHERE r.state = 'succeeded')::int AS ok, count(*)::int AS total
       FROM runs r LEFT JOIN run_attempts a ON a.run_id = r.id AND a.attempt = 1
       WHERE r.scheduled_for >= $1 AND r.scheduled_for < $2`,
      [new Date(from), new Date(end)],
    );
    // Per second: how late the first and the last of the simultaneous calls arrived.
    const bySecond = new Map<string, number[]>();
    for (const r of measured) {
      const list = bySecond.get(r.scheduledFor) ?? [];
      list.push(r.arrivedAt - Date.parse(r.scheduledFor));
      bySecond.set(r.scheduledFor, list);
    }
    const firsts = [...bySecond.values()].map((l) => Math.min(...l));
    const lasts = [...bySecond.values()].map((l) => Math.max(...l));
    const floor = await sendFloor(target, JOBS);
    const counts = target.countsByRun();
    const duplicates = [...counts].filter(([runId, n]) => runId !== '' && n > 1).length;
    const expected = JOBS * (SECONDS - WARMUP_S);
    const stats = rows[0]!;
    process.stdout.write(
      [
        `runs measured: ${measured.length} of ${expected} expected (${stats.ok}/${stats.total} succeeded in the database), duplicates: ${duplicates}`,
        `lateness ms (HTTP arrival − scheduled_for):  ${fmt(lateness)}`,
        `per second, first call of the ${JOBS}: p50 ${percentile(firsts, 50).toFixed(1)} ms; last call: p50 ${percentile(lasts, 50).toFixed(1)} ms, p99 ${percentile(lasts, 99).toFixed(1)} ms`,
        `floor on this machine (no Helios): ${JOBS} simultaneous POSTs from one undici Agent to the same target: ${fmt(floor)}`,
        `runs were created ${Number(stats.created).toFixed(0)} ms before they were due (median); claim started p99 ${Number(stats.claimed).toFixed(1)} ms after`,
        '',
      ].join('\n'),
    );
  } finally {
    await node.stop();
    await target.close();
    await db.drop();
    await etcd.delete().prefix(prefix);
    etcd.close();
  }
}

/**
 * What this machine can do at best: `n` simultaneous keep-alive POSTs from one undici Agent (what
 * a worker uses) to the same in-process target, fired at an instant, 10 rounds after a warm-up.
 * Arrival − instant, per call.
 */
async function sendFloor(target: TargetServer, n: number): Promise<number[]> {
  const agent = new Agent();
  const arrivals: number[] = [];
  try {
    for (let round = 0; round < 11; round++) {
      const before = target.requests.length;
      const at = Date.now() + 100;
      await sleep(at - Date.now());
      await Promise.all(
        Array.from({ length: n }, async () => {
          const response = await request(`${target.url}/floor`, {
            method: 'POST',
            dispatcher: agent,
            headers: {
              'content-type': 'application/json',
              'x-helios-scheduled-for': new Date(at).toISOString(),
            },
            body: '{"n":1}',
          });
          await response.body.text();
        }),
      );
      if (round > 0) arrivals.push(...target.requests.slice(before).map((r) => r.arrivedAt - at));
    }
  } finally {
    await agent.close();
  }
  return arrivals;
}

main().catch((err: unknown) => {
  console.error(err);
  process.exitCode = 1;
});
