/**
 * Herd: 10,000 jobs due in the same second on 3 nodes → time from the due instant until the last
 * HTTP call arrived at the local target. Each job's cron (`S M H * * *`) fires at that one second
 * and its next_run_at is that instant, so the leader sees all of them due at once. Also prints
 * where the time went, from the database: runs created, outbox published, runs claimed by the due
 * instant, the last call's start.
 *
 *   npm run build && npx tsx bench/herd.ts [--jobs 10000] [--runs 3] [--nodes 3] [--profile DIR] [--env HELIOS_X=Y]…
 */
import { cpus } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
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

export interface HerdRun {
  /** Due instant → the last call arrived. */
  readonly lastMs: number;
  readonly firstMs: number;
  readonly p50Ms: number;
  readonly arrived: number;
  readonly duplicates: number;
  /** Due instant → the last run row created / outbox row published / call started (negative: before). */
  readonly phases: { created: number; published: number; started: number };
  /** Runs claimed by the due instant (claimed ahead: HELIOS_CLAIM_LEAD_MS, the claim budget). */
  readonly claimedByDue: number;
  /**
   * CPU ms per run by process category, from the jobs' insert (before the dispatcher sees them)
   * until the last call arrived: dispatch, publish, claim, call and completion of every run.
   */
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
  /**
   * The same from the due instant on: claims, calls and completions only (dispatch, publish and
   * the announcements' consumption happen before it, within the lookahead). What the herd's
   * duration depends on.
   */
  readonly afterDueCpuPerRun: Record<CpuCategory | 'total', number>;
}

export interface HerdResult {
  readonly jobs: number;
  readonly runs: HerdRun[];
  readonly medianMs: number;
  /** Median over runs, per category. */
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
  readonly afterDueCpuPerRun: Record<CpuCategory | 'total', number>;
}

/** Cron (6 fields, seconds first) that fires once a day at `at`'s UTC second. */
function onceADayAt(at: Date): string {
  return `${at.getUTCSeconds()} ${at.getUTCMinutes()} ${at.getUTCHours()} * * *`;
}

/**
 * One herd on a fresh cluster. With `profileDir`, every node writes a V8 CPU profile there and
 * pg_stat_activity is sampled during the herd; both summaries are printed.
 */
export async function herdOnce(
  jobs: number,
  options: { profileDir?: string; env?: Record<string, string>; nodes?: number } = {},
): Promise<HerdRun> {
  const { profileDir } = options;
  const base = profileDir ? profiled(profileDir) : {};
  const cluster = await BenchCluster.start({
    ...base,
    nodes: options.nodes,
    env: { ...base.env, ...options.env },
  });
  const sampler = new ActivitySampler(cluster.db.pool, cluster.db.name);
  const cpu = new CpuMeter(cluster.cpuGroups());
  const whole = new CpuMeter(cluster.cpuGroups());
  const afterDue = new CpuMeter(cluster.cpuGroups());
  let cpuReport = '';
  try {
    // Far enough ahead that the insert is done before the dispatcher looks (the lookahead, 5 s by
    // default, before due).
    const lookaheadMs = Number(options.env?.HELIOS_DISPATCH_LOOKAHEAD_MS ?? 5000);
    const dueAt = await cluster.nextWholeSecond(lookaheadMs + 4000);
    await cluster.insertJobs(jobs, onceADayAt(dueAt), dueAt);
    whole.restart();
    const due = dueAt.getTime();
    if (profileDir) {
      await sleep(due - 1500 - Date.now());
      sampler.start();
      cpu.restart();
      for (const node of cluster.nodes) node.signal('SIGUSR2'); // start the CPU profiles
    }
    await sleep(due - Date.now());
    afterDue.restart();
    // Claims take no execution slot: how many of the herd's runs were claimed before it was due.
    const claimedByDue = cluster.db.pool
      .query<{ n: number }>('SELECT count(*)::int AS n FROM runs WHERE attempt > 0')
      .then(({ rows }) => rows[0]!.n);
    const deadline = due + 60_000;
    while (cluster.target.count < jobs && Date.now() < deadline) await sleep(20);
    const wholeSample = await whole.sample(cpus().length);
    const afterDueSample = await afterDue.sample(cpus().length);
    sampler.stop();
    if (profileDir) {
      cpuReport =
        `CPU during the profiled window (due − 1.5 s → last arrival):\n${await cpu.report(cpus().length, jobs)}\n` +
        `CPU of the whole herd (insert → last arrival):\n${formatCpu(wholeSample, jobs)}`;
      for (const node of cluster.nodes) node.signal('SIGUSR2'); // write the CPU profiles
      await sleep(1000);
    }
    await sleep(500); // would-be duplicates
    const arrivals = cluster.target.arrivals.map((t) => t - due);
    const { rows } = await cluster.db.pool.query<{
      created: Date;
      published: Date | null;
      started: Date | null;
    }>(
      `SELECT (SELECT max(created_at) FROM runs) AS created,
              (SELECT max(published_at) FROM outbox) AS published,
              (SELECT max(started_at) FROM run_attempts) AS started`,
    );
    const at = (d: Date | null | undefined) => (d ? d.getTime() - due : NaN);
    return {
      lastMs: arrivals.length >= jobs ? max(arrivals) : NaN,
      firstMs: Math.min(...arrivals),
      p50Ms: percentile(arrivals, 50),
      arrived: arrivals.length,
      duplicates: cluster.target.duplicates,
      phases: {
        created: at(rows[0]?.created),
        published: at(rows[0]?.published),
        started: at(rows[0]?.started),
      },
      claimedByDue: await claimedByDue,
      cpuPerRun: cpuPerRun(wholeSample, jobs),
      afterDueCpuPerRun: cpuPerRun(afterDueSample, jobs),
    };
  } finally {
    sampler.stop();
    const leader = await cluster.leader(1000).catch(() => null);
    await cluster.stop();
    if (profileDir) {
      console.log(`pg_stat_activity during the herd (mean active backends: state, wait, statement):`);
      console.log(sampler.report());
      console.log(cpuReport);
      console.log(
        `nodes: ${cluster.nodes.map((n) => `${n.name} pid ${n.pid}`).join(', ')}; leader ${leader?.node.name}`,
      );
      console.log(summariseCpuProfiles(profileDir));
    }
  }
}

export async function herd(
  jobs: number,
  options: {
    runs: number;
    profileDir?: string;
    env?: Record<string, string>;
    nodes?: number;
    log?: (line: string) => void;
  },
): Promise<HerdResult> {
  const runs: HerdRun[] = [];
  for (let i = 0; i < options.runs; i++) {
    const run = await herdOnce(jobs, options);
    runs.push(run);
    options.log?.(
      `helios run ${i + 1}: ${run.arrived}/${jobs} calls, last ${ms(run.lastMs)} after due ` +
        `(first ${ms(run.firstMs)}, p50 ${ms(run.p50Ms)}${run.duplicates ? `, ${run.duplicates} duplicates` : ''}); ` +
        `last run created ${ms(run.phases.created)}, last published ${ms(run.phases.published)}, ` +
        `last call started ${ms(run.phases.started)}; ${run.claimedByDue} claimed by the due instant`,
    );
    options.log?.(`  CPU per run (insert → last arrival): ${describeCpuPerRun(run.cpuPerRun)}`);
    options.log?.(`  of which from the due instant on: ${describeCpuPerRun(run.afterDueCpuPerRun)}`);
  }
  return {
    jobs,
    runs,
    medianMs: median(runs.map((r) => r.lastMs)),
    cpuPerRun: medianCpuPerRun(runs.map((r) => r.cpuPerRun)),
    afterDueCpuPerRun: medianCpuPerRun(runs.map((r) => r.afterDueCpuPerRun)),
  };
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      jobs: { type: 'string', default: '10000' },
      runs: { type: 'string', default: '3' },
      profile: { type: 'string' },
      env: { type: 'string', multiple: true },
      nodes: { type: 'string', default: '3' },
    },
  });
  const env = envArgs(values.env);
  const jobs = Number(values.jobs);
  const nodes = Number(values.nodes);
  console.log(`Helios herd: ${jobs} jobs due in one second, ${nodes} nodes, ${machine()}`);
  const result = await herd(jobs, {
    nodes,
    runs: Number(values.runs),
    profileDir: values.profile,
    env,
    log: (line) => console.log(`  ${line}`),
  });
  console.log(`helios: median ${ms(result.medianMs)} over ${result.runs.length} runs`);
  console.log(`CPU per run (medians): ${describeCpuPerRun(result.cpuPerRun)}`);
  console.log(`  from the due instant on: ${describeCpuPerRun(result.afterDueCpuPerRun)}`);
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
