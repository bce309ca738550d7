/**
 * Lateness at a steady load: `rate` every-second jobs (`* * * * * *`) on 3 nodes, so `rate`
 * runs/s; lateness = HTTP arrival at the local target − X-Helios-Scheduled-For. The jobs are added
 * in four steps a second apart (a cluster at a steady load is warm: a cold start at full load is a
 * herd, measured by herd.ts) and the first 10 s (connections opening, the JIT warming) are left out.
 *
 *   npm run build && npx tsx bench/lateness.ts [--rate 500] [--seconds 30] [--runs 3] [--env HELIOS_X=Y]… [--profile DIR] [--node-arg=FLAG]…
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { cpus } from 'node:os';
import { BenchCluster, profiled } from './lib/cluster.js';
import {
  ActivitySampler,
  CpuMeter,
  cpuPerRun,
  describeCpuPerRun,
  formatCpu,
  medianCpuPerRun,
  summariseCpuProfiles,
  type CpuCategory,
} from './lib/profile.js';
import { machine, max, median, ms, percentile } from './lib/stats.js';
import { envArgs } from './lib/args.js';

/** Load ramps up over the first seconds (a quarter more each second), then warms up until this. */
export const WARMUP_S = 10;
const RAMP_STEPS = 4;

export interface LatenessRun {
  readonly p50: number;
  readonly p99: number;
  readonly max: number;
  /** Requests that arrived for occurrences in the window, and how many were expected. */
  readonly received: number;
  readonly expected: number;
  readonly duplicates: number;
  /** During the window: consumer group joins (rebalances) and runs claimed by the polling fallback. */
  readonly joins: number;
  readonly polled: number;
  /** CPU ms per run by process category over the measured window (rate × seconds runs). */
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
  /** Per node: its first attempts' call starts after scheduled_for (the database's record). */
  readonly byNode: readonly NodeLateness[];
}

/** One node's share of a steady load: the first attempts it called, and how late their calls began. */
export interface NodeLateness {
  readonly node: string;
  readonly leader: boolean;
  readonly calls: number;
  readonly p50: number;
  readonly p99: number;
}

export interface LatenessResult {
  readonly rate: number;
  readonly runs: LatenessRun[];
  /** Medians over runs. */
  readonly p50: number;
  readonly p99: number;
  readonly max: number;
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
}

/** One run on a fresh cluster. */
export async function latenessOnce(
  rate: number,
  seconds: number,
  env: Record<string, string> = {},
  profileDir?: string,
  nodeArgs: string[] = [],
): Promise<LatenessRun> {
  const base = profileDir ? profiled(profileDir) : {};
  const cluster = await BenchCluster.start({
    ...base,
    env: { ...base.env, ...env },
    nodeArgs: [...(base.nodeArgs ?? []), ...nodeArgs],
  });
  const sampler = new ActivitySampler(cluster.db.pool, cluster.db.name);
  try {
    const start = await cluster.nextWholeSecond(2000);
    for (let step = 0; step < RAMP_STEPS; step++) {
      const count = Math.round((rate * (step + 1)) / RAMP_STEPS) - Math.round((rate * step) / RAMP_STEPS);
      await cluster.insertJobs(count, '* * * * * *', new Date(start.getTime() + step * 1000), `ramp${step}`);
    }
    const from = start.getTime() + WARMUP_S * 1000;
    const to = from + seconds * 1000;
    await sleep(from - Date.now());
    // CPU over the measured window: the runs due in it are what it served (rate × seconds).
    const cpu = new CpuMeter(cluster.cpuGroups());
    if (profileDir) {
      sampler.start();
      for (const node of cluster.nodes) node.signal('SIGUSR2');
    }
    await sleep(to - Date.now());
    const cpuSample = await cpu.sample(cpus().length);
    if (profileDir) {
      for (const node of cluster.nodes) node.signal('SIGUSR2');
      sampler.stop();
      console.log(formatCpu(cpuSample, rate * seconds));
      console.log('pg_stat_activity (mean active backends: state, wait, statement):');
      console.log(sampler.report());
      console.log(await phases(cluster, from, to));
      console.log(await workerSide(cluster));
    }
    await cluster.db.pool.query('UPDATE jobs SET enabled = false');
    await sleep(3000); // the last second's calls arrive
    const lateness = cluster.target.lateness(from, to);
    const { node: leader } = await cluster.leader();
    return {
      p50: percentile(lateness, 50),
      p99: percentile(lateness, 99),
      max: max(lateness),
      received: lateness.length,
      expected: rate * seconds,
      duplicates: cluster.target.duplicates,
      ...cluster.deliveryEvents(from),
      cpuPerRun: cpuPerRun(cpuSample, rate * seconds),
      byNode: await latenessByNode(cluster, from, to, leader.name),
    };
  } finally {
    sampler.stop();
    await cluster.stop();
    if (profileDir) console.log(summariseCpuProfiles(profileDir));
  }
}

/**
 * How late each node began its calls of the first attempts due in [from, to) (run_attempts'
 * started_at, when the call began, − scheduled_for): a node whose partitions wait on it (the
 * leader also dispatches and relays, and gets an equal share of the partitions) shows here.
 */
async function latenessByNode(
  cluster: BenchCluster,
  from: number,
  to: number,
  leader: string,
): Promise<NodeLateness[]> {
  const { rows } = await cluster.db.pool.query<{ node: string; calls: number; p50: number; p99: number }>(
    `SELECT a.node_id AS node, count(*)::int AS calls,
            percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM a.started_at - r.scheduled_for)) * 1000 AS p50,
            percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM a.started_at - r.scheduled_for)) * 1000 AS p99
     FROM runs r JOIN run_attempts a ON a.run_id = r.id AND a.attempt = 1
     WHERE r.scheduled_for >= $1 AND r.scheduled_for < $2
     GROUP BY a.node_id ORDER BY a.node_id`,
    [new Date(from), new Date(to)],
  );
  return rows.map((r) => ({ ...r, leader: r.node === leader }));
}

/** Where the lateness comes from, per run, from the database: percentiles of each step − scheduled_for. */
async function phases(cluster: BenchCluster, from: number, to: number): Promise<string> {
  const { rows } = await cluster.db.pool.query<Record<string, number>>(
    `WITH r AS (
       SELECT extract(epoch FROM r.created_at - r.scheduled_for) * 1000 AS created,
              extract(epoch FROM o.published_at - r.scheduled_for) * 1000 AS published,
              extract(epoch FROM a.started_at - r.scheduled_for) * 1000 AS claimed,
              extract(epoch FROM r.finished_at - r.scheduled_for) * 1000 AS finished
       FROM runs r
       JOIN outbox o ON (o.payload->>'runId')::uuid = r.id
       LEFT JOIN run_attempts a ON a.run_id = r.id AND a.attempt = 1
       WHERE r.scheduled_for >= $1 AND r.scheduled_for < $2)
     SELECT ${['created', 'published', 'claimed', 'finished']
       .map(
         (c) =>
           `percentile_cont(0.5) WITHIN GROUP (ORDER BY ${c}) AS ${c}50, percentile_cont(0.99) WITHIN GROUP (ORDER BY ${c}) AS ${c}99`,
       )
       .join(', ')}
     FROM r`,
    [new Date(from), new Date(to)],
  );
  const r = rows[0]!;
  return (
    'per run, relative to scheduled_for (p50 / p99): ' +
    ['created', 'published', 'claimed', 'finished']
      .map((c) => `${c} ${ms(r[`${c}50`]!)} / ${ms(r[`${c}99`]!)}`)
      .join(', ')
  );
}

/** The workers' own view (their Prometheus histograms, whole life): call start lateness and call duration. */
async function workerSide(cluster: BenchCluster): Promise<string> {
  const describe = async (name: string, what: string) => {
    const h = await cluster.histogram(name);
    const share = [...h.buckets]
      .filter(([le]) => [0.01, 0.05, 0.1, 0.25].includes(le))
      .map(([le, n]) => `≤ ${le * 1000} ms ${((n / h.count) * 100).toFixed(0)}%`)
      .join(', ');
    return `${what}: mean ${ms(h.mean * 1000)}; ${share}`;
  };
  return [
    await describe('helios_run_start_lateness_seconds', 'workers: call started after scheduled_for'),
    await describe('helios_run_http_seconds', 'workers: HTTP call duration'),
  ].join('\n');
}

export async function lateness(
  rate: number,
  options: {
    seconds: number;
    runs: number;
    env?: Record<string, string>;
    profileDir?: string;
    /** Arguments for node itself (V8 flags NODE_OPTIONS does not allow). */
    nodeArgs?: string[];
    log?: (line: string) => void;
  },
): Promise<LatenessResult> {
  const runs: LatenessRun[] = [];
  for (let i = 0; i < options.runs; i++) {
    const run = await latenessOnce(rate, options.seconds, options.env, options.profileDir, options.nodeArgs);
    runs.push(run);
    options.log?.(
      `${rate} runs/s run ${i + 1}: p50 ${ms(run.p50)}  p99 ${ms(run.p99)}  max ${ms(run.max)}  ` +
        `(${run.received}/${run.expected} calls arrived${run.duplicates ? `, ${run.duplicates} duplicates` : ''}` +
        `${run.joins ? `, ${run.joins} consumer group joins` : ''}${run.polled ? `, ${run.polled} runs claimed by polling` : ''})`,
    );
    options.log?.(`  CPU per run: ${describeCpuPerRun(run.cpuPerRun)}`);
    options.log?.(
      `  calls begun after scheduled_for, by node (p50 / p99): ${run.byNode
        .map((n) => `${n.node}${n.leader ? ' (leader)' : ''} ${n.calls} calls ${ms(n.p50)} / ${ms(n.p99)}`)
        .join('; ')}`,
    );
  }
  return {
    rate,
    runs,
    p50: median(runs.map((r) => r.p50)),
    p99: median(runs.map((r) => r.p99)),
    max: median(runs.map((r) => r.max)),
    cpuPerRun: medianCpuPerRun(runs.map((r) => r.cpuPerRun)),
  };
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      rate: { type: 'string', multiple: true },
      seconds: { type: 'string', default: '30' },
      runs: { type: 'string', default: '3' },
      env: { type: 'string', multiple: true },
      profile: { type: 'string' },
      'node-arg': { type: 'string', multiple: true },
    },
  });
  const env = envArgs(values.env);
  console.log(`lateness on 3 nodes, ${machine()}`);
  for (const rate of (values.rate ?? ['100', '500', '2000']).map(Number)) {
    const result = await lateness(rate, {
      seconds: Number(values.seconds),
      runs: Number(values.runs),
      env,
      profileDir: values.profile,
      nodeArgs: values['node-arg'],
      log: (line) => console.log(`  ${line}`),
    });
    console.log(
      `${rate} runs/s: p50 ${ms(result.p50)}  p99 ${ms(result.p99)}  max ${ms(result.max)} (median of ${result.runs.length})`,
    );
  }
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
