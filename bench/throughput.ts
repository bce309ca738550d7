/**
 * Sustained throughput on 3 nodes: every-second jobs added step by step (offered load 1,000 →
 * 5,000 runs/s), each step held for a while; per step, the runs/s that completed (HTTP call
 * arrived at the target) and the queue depth sampled every second: jobs whose occurrence is
 * overdue but not yet a run, outbox rows not yet published, queued runs already due, and runs
 * claimed ahead and still waiting in a worker for a slot after they fell due. A step is
 * *sustained* when ≥ 95% of the offered runs completed and the backlog stayed bounded: below two
 * seconds' worth of load at the end, by the depth and by the calls' lateness (the median lateness
 * of the calls that arrived in the step's last 5 s, against its first 5 s after the settle, shows a
 * backlog growing anywhere, a worker's queue included). Then the highest sustained rate is held
 * for 60 s.
 *
 *   npm run build && npx tsx bench/throughput.ts [--steps 1000,1500,2000,…] [--step-seconds 20] [--hold 60] [--env HELIOS_X=Y]… [--node-arg=--max-opt=2]…
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { envArgs } from './lib/args.js';
import { BenchCluster } from './lib/cluster.js';
import { machine, max, median, ms } from './lib/stats.js';
import type { RecordingTarget } from './lib/target.js';

export interface ThroughputStep {
  readonly offered: number;
  readonly seconds: number;
  /** Calls that arrived per second, over the step after its first 5 s. */
  readonly completed: number;
  /** Largest sampled depth, and the depth at the end of the step. */
  readonly maxDepth: number;
  readonly endDepth: number;
  /** Median lateness (arrival − scheduled, ms) of the calls that arrived in the first / last 5 s. */
  readonly lateness: { readonly first: number; readonly last: number };
  readonly sustained: boolean;
}

export interface ThroughputResult {
  readonly steps: ThroughputStep[];
  /** The 60 s hold at the highest sustained step (null when none was sustained). */
  readonly hold: ThroughputStep | null;
}

const SETTLE_S = 5;

/** Overdue work anywhere in the pipeline, by the database clock. */
const DEPTH = `
  SELECT (SELECT count(*) FROM jobs WHERE enabled AND next_run_at < now() - interval '1 second')
       + (SELECT count(*) FROM outbox WHERE published_at IS NULL AND publish_after < now() - interval '1 second')
       + (SELECT count(*) FROM runs WHERE state = 'queued' AND not_before < now() - interval '1 second')
       + (SELECT count(*) FROM runs WHERE state = 'running' AND started_at IS NULL
            AND not_before < now() - interval '1 second')
       AS depth`;

/** Seconds at each end of a step whose arrivals' lateness is compared. */
const LATENESS_S = 5;

/** Median lateness (ms) of the calls that arrived in [from, to). */
function arrivalsLateness(target: RecordingTarget, from: number, to: number): number {
  const late: number[] = [];
  target.arrivals.forEach((t, i) => {
    if (t >= from && t < to) late.push(t - target.scheduled[i]!);
  });
  return median(late);
}

async function step(
  cluster: BenchCluster,
  offered: number,
  seconds: number,
  added: number,
): Promise<ThroughputStep> {
  const at = await cluster.nextWholeSecond(1500);
  if (offered > added) await cluster.insertJobs(offered - added, '* * * * * *', at, `tp${offered}`);
  const depths: number[] = [];
  const end = at.getTime() + seconds * 1000;
  while (Date.now() < end) {
    const { rows } = await cluster.db.pool.query<{ depth: string }>(DEPTH);
    depths.push(Number(rows[0]!.depth));
    await sleep(1000);
  }
  const from = at.getTime() + SETTLE_S * 1000;
  let arrived = 0;
  for (const t of cluster.target.arrivals) if (t >= from && t < end) arrived++;
  const completed = arrived / ((end - from) / 1000);
  const endDepth = depths.at(-1) ?? 0;
  const lateness = {
    first: arrivalsLateness(cluster.target, from, from + LATENESS_S * 1000),
    last: arrivalsLateness(cluster.target, end - LATENESS_S * 1000, end),
  };
  return {
    offered,
    seconds,
    completed,
    maxDepth: max(depths),
    endDepth,
    lateness,
    sustained: completed >= 0.95 * offered && endDepth <= 2 * offered && lateness.last <= 2000,
  };
}

export async function throughput(options: {
  steps: number[];
  stepSeconds: number;
  holdSeconds: number;
  /** Extra environment of every node (HELIOS_…). */
  env?: Record<string, string>;
  /** Arguments for node itself (V8 flags NODE_OPTIONS does not allow). */
  nodeArgs?: string[];
  log?: (line: string) => void;
}): Promise<ThroughputResult> {
  const describe = (s: ThroughputStep) =>
    `offered ${s.offered} runs/s for ${s.seconds} s: completed ${s.completed.toFixed(0)} runs/s, queue depth max ${s.maxDepth}, ` +
    `at the end ${s.endDepth}, calls' median lateness ${ms(s.lateness.first)} → ${ms(s.lateness.last)} ` +
    `→ ${s.sustained ? 'sustained' : 'NOT sustained'}`;
  const steps: ThroughputStep[] = [];
  let best: number | null = null;
  const cluster = await BenchCluster.start({ env: options.env, nodeArgs: options.nodeArgs });
  try {
    let added = 0;
    for (const offered of options.steps) {
      const result = await step(cluster, offered, options.stepSeconds, added);
      added = Math.max(added, offered);
      steps.push(result);
      options.log?.(describe(result));
      if (!result.sustained) break;
      best = offered;
    }
  } finally {
    await cluster.stop();
  }
  if (best === null || options.holdSeconds <= 0) return { steps, hold: null };
  // The hold on a fresh cluster, so the backlog of a failed step does not count against it.
  const fresh = await BenchCluster.start({ env: options.env, nodeArgs: options.nodeArgs });
  try {
    const hold = await step(fresh, best, options.holdSeconds, 0);
    options.log?.(`hold: ${describe(hold)}`);
    return { steps, hold };
  } finally {
    await fresh.stop();
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      steps: { type: 'string', default: '1000,1500,2000,2500,3000,4000,5000' },
      'step-seconds': { type: 'string', default: '20' },
      hold: { type: 'string', default: '60' },
      env: { type: 'string', multiple: true },
      'node-arg': { type: 'string', multiple: true },
    },
  });
  console.log(`sustained throughput on 3 nodes, ${machine()}`);
  const result = await throughput({
    steps: values.steps.split(',').map(Number),
    stepSeconds: Number(values['step-seconds']),
    holdSeconds: Number(values.hold),
    env: envArgs(values.env),
    nodeArgs: values['node-arg'],
    log: (line) => console.log(`  ${line}`),
  });
  const best = result.hold ?? result.steps.filter((s) => s.sustained).at(-1);
  console.log(
    best
      ? `sustained: ${best.completed.toFixed(0)} runs/s for ${best.seconds} s (queue depth max ${best.maxDepth})`
      : 'no step was sustained',
  );
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
