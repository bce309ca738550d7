/**
 * Memory: peak RSS (VmHWM from /proc/<pid>/status) of each of 3 nodes with 10,000 jobs defined,
 * each firing once a minute at its own second (≈ 167 runs/s spread over the minute), after they
 * all fired at least once.
 *
 *   npm run build && npx tsx bench/memory.ts [--jobs 10000] [--seconds 65] [--env K=V]…
 *     [--node-arg=--single-threaded-gc]…   (arguments for node itself: V8 flags NODE_OPTIONS refuses)
 */
import { readFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { BenchCluster } from './lib/cluster.js';
import { machine } from './lib/stats.js';
import { envArgs } from './lib/args.js';

export interface MemoryResult {
  readonly jobs: number;
  /** Per node: peak and current resident set, MB, and CPU used since it started (user + system), s. */
  readonly nodes: { name: string; peakMb: number; rssMb: number; cpuS: number }[];
  readonly calls: number;
}

/** CPU seconds (user + system) a process used, from /proc/<pid>/stat (USER_HZ = 100). */
function cpuSeconds(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return (Number(fields[11]) + Number(fields[12])) / 100;
}

/** A field of /proc/<pid>/status in MB (the kernel reports kB). */
function statusMb(pid: number, field: 'VmHWM' | 'VmRSS'): number {
  const match = new RegExp(`^${field}:\\s+(\\d+) kB`, 'm').exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  return match ? Number(match[1]) / 1024 : NaN;
}

export async function memory(
  jobs: number,
  seconds: number,
  env: Record<string, string> = {},
  nodeArgs: string[] = [],
): Promise<MemoryResult> {
  const cluster = await BenchCluster.start({ env, nodeArgs });
  try {
    const start = await cluster.nextWholeSecond(2000);
    // Job n fires at second n mod 60 of every minute: the 10,000 jobs are spread evenly.
    await cluster.db.pool.query(
      `INSERT INTO jobs (name, schedule, target, timeout_ms, next_run_at)
       SELECT 'mem-' || n, (n % 60) || ' * * * * *', $1, 5000,
              $2::timestamptz + ((n % 60 - extract(second FROM $2::timestamptz)::int + 60) % 60) * interval '1 second'
       FROM generate_series(1, $3) AS n`,
      [{ url: `${cluster.target.url}/tick`, method: 'POST', body: { bench: true } }, start, jobs],
    );
    await sleep(start.getTime() + seconds * 1000 - Date.now());
    const nodes = cluster.live.map((node) => ({
      name: node.name,
      peakMb: statusMb(node.pid, 'VmHWM'),
      rssMb: statusMb(node.pid, 'VmRSS'),
      cpuS: cpuSeconds(node.pid),
    }));
    return { jobs, nodes, calls: cluster.target.count };
  } finally {
    await cluster.stop();
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      jobs: { type: 'string', default: '10000' },
      seconds: { type: 'string', default: '65' },
      env: { type: 'string', multiple: true },
      'node-arg': { type: 'string', multiple: true },
    },
  });
  const env = envArgs(values.env);
  const result = await memory(Number(values.jobs), Number(values.seconds), env, values['node-arg']);
  console.log(`memory with ${result.jobs} jobs defined (${result.calls} calls made), ${machine()}`);
  // The CPU is the nodes' whole life (start, the jobs' insert, every run), for comparing node
  // flags that trade memory for CPU on the same workload.
  for (const n of result.nodes)
    console.log(
      `  ${n.name}: peak RSS ${n.peakMb.toFixed(0)} MB, now ${n.rssMb.toFixed(0)} MB, CPU ${n.cpuS.toFixed(1)} s`,
    );
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
