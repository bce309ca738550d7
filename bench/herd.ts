/**
 * Herd: 10,000 jobs due in the same second on 3 nodes → time from the due instant until the last
 * HTTP call arrived at the local target. Each job's cron (`S M H * * *`) fires at that one second
 * and its next_run_at is that instant, so the leader sees all of them due at once.
 *
 * Each run starts a fresh cluster and gives it herds of the same size (lib/herd-rounds.ts): the
 * first (cold) meets freshly started processes, so JIT warm-up is a large part of it; the second
 * finishes it (V8's optimizing tier); the third (warm), inserted 2 s after the second's last call,
 * on the same processes, is what a scheduler that has been running meets at the top of the hour,
 * and is the measured figure. The cold herd's last arrival (and its CPU per run after due) and the
 * second's are reported beside it. Every other figure describes the warm herd: where
 * the time went, from the database (runs created, outbox published, runs claimed by the due
 * instant, the last call's start), the CPU per run, and with --profile the profiles and
 * pg_stat_activity.
 *
 *   npm run build && npx tsx bench/herd.ts [--jobs 10000] [--runs 3] [--nodes 3] [--profile DIR] [--env HELIOS_X=Y]…
 *     [--node-arg=--single-threaded-gc]…   (arguments for node itself: V8 flags NODE_OPTIONS refuses)
 *     [--warmups N]   (herds before the measured one, the cold herd included: lib/herd-rounds.ts)
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
import { deciles, machine, max, median, ms, percentile } from './lib/stats.js';
import { envArgs } from './lib/args.js';
import { DEFAULT_WARMUP_HERDS, HERD_SETTLE_MS, warmupHerds } from './lib/herd-rounds.js';
import type { RecordingTarget } from './lib/target.js';
import { DEFAULT_DISPATCH_LOOKAHEAD_MS } from '../src/config/index.js';

/** The first herd of a run, on freshly started nodes. */
export interface ColdHerd {
  /** Due instant → the last call arrived. */
  readonly lastMs: number;
  readonly arrived: number;
  readonly duplicates: number;
  /** CPU ms per run by process category, from the due instant to the last arrival. */
  readonly afterDueCpuPerRun: Record<CpuCategory | 'total', number>;
}

/** One run: the warm herd's figures (the last herd on the same nodes), and the cold herd's. */
export interface HerdRun {
  /** Due instant → the last call arrived. */
  readonly lastMs: number;
  readonly firstMs: number;
  readonly p50Ms: number;
  /** Arrivals' deciles, ms after due (see stats.ts deciles). */
  readonly deciles: string;
  readonly arrived: number;
  readonly duplicates: number;
  /** Due instant → the last run row created / outbox row published / call started (negative: before). */
  readonly phases: { created: number; published: number; started: number };
  /** Runs claimed by the due instant (claimed ahead: HELIOS_CLAIM_LEAD_MS, the claim budget). */
  readonly claimedByDue: number;
  /**
   * Per node: its calls, when its last call started (ms after due), and its calls started in each
   * 100 ms after due (index 0: the first tenth of a second; before due counts in 0).
   */
  readonly byNode: readonly { node: string; calls: number; lastStartedMs: number; perTenth: number[] }[];
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
  /**
   * Due instant → the last run recorded finished in PostgreSQL, and the CPU per run from the due
   * instant until then: a worker holds successes' writes while its calls are underway
   * (batching.ts), so part of a herd's completions come after its last arrival.
   */
  readonly recordedMs: number;
  readonly recordedCpuPerRun: Record<CpuCategory | 'total', number>;
  /** The first herd of the same run, on the same (then freshly started) nodes. */
  readonly cold: ColdHerd;
  /** The last arrival of each further warm-up herd (`--warmups`), ms after its due instant. */
  readonly warmupMs: readonly number[];
}

export interface HerdResult {
  readonly jobs: number;
  readonly runs: HerdRun[];
  /** Median over runs of the warm herd's lastMs: the measured figure. */
  readonly medianMs: number;
  /** Median over runs of the cold herd's lastMs. */
  readonly coldMedianMs: number;
  /** Median over runs, per category (warm herd). */
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
  readonly afterDueCpuPerRun: Record<CpuCategory | 'total', number>;
  /** From the due instant until the last run was recorded finished (HerdRun.recordedCpuPerRun). */
  readonly recordedCpuPerRun: Record<CpuCategory | 'total', number>;
  /** The same for the cold herd, from its due instant on. */
  readonly coldAfterDueCpuPerRun: Record<CpuCategory | 'total', number>;
}

// Both queries see only one herd: its runs are those scheduled for its due instant (the cold and
// the warm herd are due at different seconds, and each job fires once a day).

/** Runs of the herd not yet recorded finished, and the last finish. $1 = the herd's due instant. */
const RECORDED = `
  SELECT count(*) FILTER (WHERE finished_at IS NULL)::int AS open, max(finished_at) AS last
  FROM runs WHERE scheduled_for = $1`;

/** Runs of the herd already claimed. $1 = the herd's due instant. */
const CLAIMED = 'SELECT count(*)::int AS n FROM runs WHERE scheduled_for = $1 AND attempt > 0';

/**
 * The herd's last run created, announcement published (an outbox row's key is its run's job id)
 * and call started. $1 = the herd's due instant.
 */
const PHASES = `
  WITH herd AS (SELECT id, job_id, created_at FROM runs WHERE scheduled_for = $1)
  SELECT (SELECT max(created_at) FROM herd) AS created,
         (SELECT max(published_at) FROM outbox WHERE key IN (SELECT job_id::text FROM herd)) AS published,
         (SELECT max(started_at) FROM run_attempts WHERE run_id IN (SELECT id FROM herd)) AS started`;

/**
 * The herd's calls by node: how many each made and when its last one started. Claims ahead are
 * each node's own (from its partitions), so a node that falls behind finishes the herd alone.
 * $1 = the herd's due instant.
 */
const BY_NODE = `
  SELECT a.node_id AS node, count(*)::int AS calls, max(a.started_at) AS "lastStarted"
  FROM run_attempts a JOIN runs r ON r.id = a.run_id
  WHERE r.scheduled_for = $1 AND a.outcome = 'succeeded'
  GROUP BY a.node_id ORDER BY a.node_id`;

/**
 * The herd's calls started per node and 100 ms after the due instant ($1): where a node's rate
 * falls (the last tenth of a herd is where Helios loses to pg-boss: docs/performance.md).
 */
const STARTS_PER_TENTH = `
  SELECT a.node_id AS node, floor(extract(epoch FROM a.started_at - $1::timestamptz) * 10)::int AS tenth,
         count(*)::int AS calls
  FROM run_attempts a JOIN runs r ON r.id = a.run_id
  WHERE r.scheduled_for = $1 AND a.outcome = 'succeeded'
  GROUP BY 1, 2 ORDER BY 1, 2`;

/**
 * Waits until every run of the herd due at `due` is recorded finished (polling every 20 ms, for
 * at most 30 s); returns when the last one finished (epoch ms, the database's clock).
 */
async function herdRecorded(cluster: BenchCluster, due: number): Promise<number> {
  const deadline = Date.now() + 30_000;
  for (;;) {
    const { rows } = await cluster.db.pool.query<{ open: number; last: Date | null }>(RECORDED, [
      new Date(due),
    ]);
    if (rows[0]!.open === 0) return rows[0]!.last?.getTime() ?? NaN;
    if (Date.now() > deadline) return NaN;
    await sleep(20);
  }
}

/** Cron (6 fields, seconds first) that fires once a day at `at`'s UTC second. */
function onceADayAt(at: Date): string {
  return `${at.getUTCSeconds()} ${at.getUTCMinutes()} ${at.getUTCHours()} * * *`;
}

/**
 * Inserts `jobs` jobs named `${prefix}-n`, due at one whole second; returns that instant (ms).
 * Far enough ahead that the insert is done before the dispatcher looks (the lookahead, 5.5 s by
 * default, before due).
 */
async function insertHerd(cluster: BenchCluster, jobs: number, prefix: string, lookaheadMs: number) {
  const dueAt = await cluster.nextWholeSecond(lookaheadMs + 4000);
  await cluster.insertJobs(jobs, onceADayAt(dueAt), dueAt, prefix);
  return dueAt.getTime();
}

/** Waits until `jobs` distinct runs scheduled for `due` have called the target, or 60 s after due. */
async function herdArrived(target: RecordingTarget, due: number, jobs: number): Promise<void> {
  const deadline = due + 60_000;
  while (target.runsCalledFor(due) < jobs && Date.now() < deadline) await sleep(20);
}

/**
 * Arrivals of the herd due at `due`, in ms after it, and its last arrival (NaN when not every run
 * of it called).
 */
function herdArrivals(target: RecordingTarget, due: number, jobs: number) {
  const complete = target.runsCalledFor(due) >= jobs;
  const arrivals = target.arrivalsFor(due).map((t) => t - due);
  return { arrivals, lastMs: complete ? max(arrivals) : NaN };
}

/**
 * One run on a fresh cluster: a cold herd, the further warm-up herds, then the measured warm herd. With `profileDir`, every
 * node writes a V8 CPU profile of the warm herd there and pg_stat_activity is sampled during it;
 * both summaries are printed.
 */
export async function herdOnce(
  jobs: number,
  options: {
    profileDir?: string;
    env?: Record<string, string>;
    nodes?: number;
    nodeArgs?: string[];
    /** Herds before the measured one, the cold herd included (lib/herd-rounds.ts). */
    warmups?: number;
  } = {},
): Promise<HerdRun> {
  const { profileDir } = options;
  const base = profileDir ? profiled(profileDir) : {};
  const cluster = await BenchCluster.start({
    ...base,
    nodes: options.nodes,
    env: { ...base.env, ...options.env },
    nodeArgs: [...(base.nodeArgs ?? []), ...(options.nodeArgs ?? [])],
  });
  const sampler = new ActivitySampler(cluster.db.pool, cluster.db.name);
  const cpu = new CpuMeter(cluster.cpuGroups());
  const whole = new CpuMeter(cluster.cpuGroups());
  const afterDue = new CpuMeter(cluster.cpuGroups());
  const untilRecorded = new CpuMeter(cluster.cpuGroups());
  let cpuReport = '';
  try {
    const lookaheadMs = Number(options.env?.HELIOS_DISPATCH_LOOKAHEAD_MS ?? DEFAULT_DISPATCH_LOOKAHEAD_MS);
    // Cold: the first herd these processes see, JIT warm-up included. Its jobs fire once a day,
    // so they stay out of the warm herd.
    const coldDue = await insertHerd(cluster, jobs, 'cold', lookaheadMs);
    await sleep(coldDue - Date.now());
    const coldAfterDue = new CpuMeter(cluster.cpuGroups());
    await herdArrived(cluster.target, coldDue, jobs);
    const coldAfterDueSample = await coldAfterDue.sample(cpus().length);
    await sleep(HERD_SETTLE_MS);
    // Further warm-up herds, unmeasured but for their last arrival.
    const warmupMs: number[] = [];
    for (let i = 2; i <= (options.warmups ?? DEFAULT_WARMUP_HERDS); i++) {
      const warmupDue = await insertHerd(cluster, jobs, `warmup${i}`, lookaheadMs);
      await sleep(warmupDue - Date.now());
      await herdArrived(cluster.target, warmupDue, jobs);
      warmupMs.push(herdArrivals(cluster.target, warmupDue, jobs).lastMs);
      await sleep(HERD_SETTLE_MS);
    }

    // Warm: the same herd on the same processes, with its own jobs (warm-n) and due instant.
    const due = await insertHerd(cluster, jobs, 'warm', lookaheadMs);
    whole.restart();
    if (profileDir) {
      await sleep(due - 1500 - Date.now());
      sampler.start();
      cpu.restart();
      for (const node of cluster.nodes) node.signal('SIGUSR2'); // start the CPU profiles
    }
    await sleep(due - Date.now());
    afterDue.restart();
    untilRecorded.restart();
    // Claims take no execution slot: how many of the herd's runs were claimed before it was due.
    const claimedByDue = cluster.db.pool
      .query<{ n: number }>(CLAIMED, [new Date(due)])
      .then(({ rows }) => rows[0]!.n);
    await herdArrived(cluster.target, due, jobs);
    const wholeSample = await whole.sample(cpus().length);
    const afterDueSample = await afterDue.sample(cpus().length);
    const recorded = await herdRecorded(cluster, due);
    const recordedSample = await untilRecorded.sample(cpus().length);
    sampler.stop();
    if (profileDir) {
      cpuReport =
        `CPU during the profiled window (due − 1.5 s → last arrival):\n${await cpu.report(cpus().length, jobs)}\n` +
        `CPU of the whole herd (insert → last arrival):\n${formatCpu(wholeSample, jobs)}`;
      for (const node of cluster.nodes) node.signal('SIGUSR2'); // write the CPU profiles
      await sleep(1000);
    }
    await sleep(500); // would-be duplicates
    const { arrivals, lastMs } = herdArrivals(cluster.target, due, jobs);
    const cold = herdArrivals(cluster.target, coldDue, jobs);
    const { rows } = await cluster.db.pool.query<{
      created: Date;
      published: Date | null;
      started: Date | null;
    }>(PHASES, [new Date(due)]);
    const at = (d: Date | null | undefined) => (d ? d.getTime() - due : NaN);
    const lastCreatedMs = at(rows[0]?.created);
    if (lastCreatedMs > 0) {
      // Dispatch is seconds ahead of the herd: runs created after it fell due mean an incident.
      console.log(
        `  the warm herd's last run was created ${Math.round(lastCreatedMs)} ms after due; the nodes said:`,
      );
      for (const line of cluster.incidents(due - lookaheadMs - 5000)) console.log(`    ${line}`);
    }
    const { rows: nodes } = await cluster.db.pool.query<{ node: string; calls: number; lastStarted: Date }>(
      BY_NODE,
      [new Date(due)],
    );
    const { rows: tenths } = await cluster.db.pool.query<{ node: string; tenth: number; calls: number }>(
      STARTS_PER_TENTH,
      [new Date(due)],
    );
    const perTenth = (node: string) => {
      const counts: number[] = [];
      for (const t of tenths.filter((r) => r.node === node)) {
        const at = Math.max(0, t.tenth);
        while (counts.length <= at) counts.push(0);
        counts[at]! += t.calls;
      }
      return counts;
    };
    return {
      lastMs,
      firstMs: Math.min(...arrivals),
      p50Ms: percentile(arrivals, 50),
      deciles: deciles(arrivals),
      arrived: arrivals.length,
      duplicates: cluster.target.duplicatesFor(due),
      phases: {
        created: lastCreatedMs,
        published: at(rows[0]?.published),
        started: at(rows[0]?.started),
      },
      claimedByDue: await claimedByDue,
      byNode: nodes.map((n) => ({
        node: n.node,
        calls: n.calls,
        lastStartedMs: at(n.lastStarted),
        perTenth: perTenth(n.node),
      })),
      cpuPerRun: cpuPerRun(wholeSample, jobs),
      afterDueCpuPerRun: cpuPerRun(afterDueSample, jobs),
      recordedMs: recorded - due,
      recordedCpuPerRun: cpuPerRun(recordedSample, jobs),
      warmupMs,
      cold: {
        lastMs: cold.lastMs,
        arrived: cold.arrivals.length,
        duplicates: cluster.target.duplicatesFor(coldDue),
        afterDueCpuPerRun: cpuPerRun(coldAfterDueSample, jobs),
      },
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
    /** Arguments for node itself (V8 flags NODE_OPTIONS does not allow). */
    nodeArgs?: string[];
    warmups?: number;
    log?: (line: string) => void;
  },
): Promise<HerdResult> {
  const runs: HerdRun[] = [];
  for (let i = 0; i < options.runs; i++) {
    const run = await herdOnce(jobs, options);
    runs.push(run);
    options.log?.(
      `helios run ${i + 1}, cold herd (fresh nodes): ${run.cold.arrived}/${jobs} calls, last ${ms(run.cold.lastMs)} ` +
        `after due${run.cold.duplicates ? ` (${run.cold.duplicates} duplicates)` : ''}; ` +
        `CPU per run from the due instant on: ${describeCpuPerRun(run.cold.afterDueCpuPerRun)}`,
    );
    if (run.warmupMs.length)
      options.log?.(
        `helios run ${i + 1}, further warm-up herds: last ${run.warmupMs.map(ms).join(', ')} after due`,
      );
    options.log?.(
      `helios run ${i + 1}, warm herd (same nodes): ${run.arrived}/${jobs} calls, last ${ms(run.lastMs)} after due ` +
        `(first ${ms(run.firstMs)}, p50 ${ms(run.p50Ms)}${run.duplicates ? `, ${run.duplicates} duplicates` : ''}); ` +
        `last run created ${ms(run.phases.created)}, last published ${ms(run.phases.published)}, ` +
        `last call started ${ms(run.phases.started)}; ${run.claimedByDue} claimed by the due instant; ` +
        `arrivals' deciles ${run.deciles} ms`,
    );
    options.log?.(
      `  by node: ${run.byNode.map((n) => `${n.node} ${n.calls} calls, last started ${ms(n.lastStartedMs)}`).join('; ')}`,
    );
    for (const n of run.byNode)
      options.log?.(`    ${n.node} calls started per 100 ms after due: ${n.perTenth.join(' ')}`);
    options.log?.(`  CPU per run (insert → last arrival): ${describeCpuPerRun(run.cpuPerRun)}`);
    options.log?.(`  of which from the due instant on: ${describeCpuPerRun(run.afterDueCpuPerRun)}`);
    options.log?.(
      `  last run recorded finished ${ms(run.recordedMs)} after due; CPU per run from the due instant until then: ` +
        describeCpuPerRun(run.recordedCpuPerRun),
    );
  }
  return {
    jobs,
    runs,
    medianMs: median(runs.map((r) => r.lastMs)),
    coldMedianMs: median(runs.map((r) => r.cold.lastMs)),
    cpuPerRun: medianCpuPerRun(runs.map((r) => r.cpuPerRun)),
    afterDueCpuPerRun: medianCpuPerRun(runs.map((r) => r.afterDueCpuPerRun)),
    recordedCpuPerRun: medianCpuPerRun(runs.map((r) => r.recordedCpuPerRun)),
    coldAfterDueCpuPerRun: medianCpuPerRun(runs.map((r) => r.cold.afterDueCpuPerRun)),
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
      'node-arg': { type: 'string', multiple: true },
      warmups: { type: 'string' },
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
    nodeArgs: values['node-arg'],
    warmups: warmupHerds(values.warmups),
    log: (line) => console.log(`  ${line}`),
  });
  console.log(
    `helios: warm herd median ${ms(result.medianMs)} over ${result.runs.length} runs ` +
      `(cold herd, fresh nodes: ${ms(result.coldMedianMs)})`,
  );
  console.log(`CPU per run, warm herd (medians): ${describeCpuPerRun(result.cpuPerRun)}`);
  console.log(`  from the due instant on: ${describeCpuPerRun(result.afterDueCpuPerRun)}`);
  console.log(`  from the due instant until recorded: ${describeCpuPerRun(result.recordedCpuPerRun)}`);
  console.log(`  cold herd, from the due instant on: ${describeCpuPerRun(result.coldAfterDueCpuPerRun)}`);
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
