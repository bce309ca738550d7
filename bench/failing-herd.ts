/**
 * A herd whose target is down: 10,000 jobs due in the same second on 3 fresh nodes, each call
 * answered 503 at once by a local server (or, with --refused, refused: nothing listens on the
 * port). Measures the due instant → the last first attempt recorded (every run's attempt 1 has an
 * outcome), what those outcomes are (`failed` is the right one; `cancelled` is a claim handed back
 * uncalled, `expired` a claim that ran out before its failure was written), and the CPU per run by
 * process over that window. Retries are due a minute later, outside it. One herd per run (cold
 * processes: the failure path's cost, not the JIT's warm-up, is what this is for).
 *
 * `--attempts 1` makes each first attempt the last: every run is buried (a dead letter and its
 * announcement) instead of retried.
 *
 * `--profile DIR`: every node writes a V8 CPU profile of that window there, summarised at the end.
 *
 *   npm run build && npx tsx bench/failing-herd.ts [--jobs 10000] [--runs 3] [--refused] [--attempts 3] [--profile DIR] [--env K=V]…
 */
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { cpus } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { envArgs } from './lib/args.js';
import { BenchCluster, profiled } from './lib/cluster.js';
import {
  CpuMeter,
  cpuPerRun,
  describeCpuPerRun,
  medianCpuPerRun,
  summariseCpuProfiles,
  type CpuCategory,
} from './lib/profile.js';
import { machine, median } from './lib/stats.js';

export interface FailingHerdRun {
  /** Due instant → the last first attempt recorded, ms (null: not all within the time limit). */
  readonly recordedMs: number | null;
  /** First attempts by outcome when the last was recorded (or at the time limit). */
  readonly outcomes: Record<string, number>;
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
  /** Log lines the nodes wrote from the due instant until the last was recorded. */
  readonly logLines: number;
}

/** How long after the due instant a run gives up waiting for the outcomes. */
const LIMIT_MS = 60_000;

/** A local target that answers 503 at once; closed: a port nothing listens on. */
async function failingTarget(refused: boolean): Promise<{ url: string; close: () => Promise<void> }> {
  const server = createServer((req, res) => {
    req.resume();
    res.writeHead(503, { 'content-type': 'text/plain' }).end('down');
  });
  server.keepAliveTimeout = 60_000;
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/tick`;
  const close = () => new Promise<void>((resolve) => server.close(() => resolve()));
  if (refused) await close();
  return { url, close: refused ? async () => undefined : close };
}

export async function failingHerdOnce(
  jobs: number,
  refused: boolean,
  env: Record<string, string>,
  attempts = 3,
  profileDir?: string,
): Promise<FailingHerdRun> {
  const target = await failingTarget(refused);
  const base = profileDir ? profiled(profileDir) : {};
  const cluster = await BenchCluster.start({ ...base, env: { ...base.env, ...env } });
  try {
    const due = await cluster.nextWholeSecond(6000);
    // One schedule matching the due second (`S M H * * *`), retries a minute after a failure.
    await cluster.db.pool.query(
      `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, next_run_at)
       SELECT 'down-' || n, to_char($2::timestamptz AT TIME ZONE 'UTC', 'FMSS FMMI FMHH24') || ' * * *',
              $1, 5000, $4, 60000, $2
       FROM generate_series(1, $3) AS n`,
      [{ url: target.url, method: 'POST', body: { bench: true } }, due, jobs, attempts],
    );
    await sleep(due.getTime() - Date.now());
    const linesBefore = cluster.nodes.reduce((n, node) => n + node.logs.length, 0);
    const cpu = new CpuMeter(cluster.cpuGroups());
    if (profileDir) for (const node of cluster.nodes) node.signal('SIGUSR2');
    let recordedMs: number | null = null;
    let outcomes: Record<string, number> = {};
    for (;;) {
      const { rows } = await cluster.db.pool.query<{ outcome: string | null; n: number; last: Date | null }>(
        `SELECT a.outcome, count(*)::int AS n, max(a.finished_at) AS last
         FROM run_attempts a WHERE a.attempt = 1 GROUP BY 1`,
      );
      outcomes = Object.fromEntries(rows.map((r) => [r.outcome ?? 'pending', r.n]));
      const settled = rows.filter((r) => r.outcome !== null).reduce((sum, r) => sum + r.n, 0);
      if (settled >= jobs) {
        const last = Math.max(...rows.map((r) => r.last?.getTime() ?? 0));
        recordedMs = last - due.getTime();
        break;
      }
      if (Date.now() - due.getTime() > LIMIT_MS) break;
      await sleep(50);
    }
    const sample = await cpu.sample(cpus().length);
    const logLines = cluster.nodes.reduce((n, node) => n + node.logs.length, 0) - linesBefore;
    if (profileDir) {
      for (const node of cluster.nodes) node.signal('SIGUSR2');
      await sleep(2000); // the profiles are written
    }
    return { recordedMs, outcomes, cpuPerRun: cpuPerRun(sample, jobs), logLines };
  } finally {
    await cluster.stop();
    await target.close();
  }
}

export interface FailingHerdResult {
  readonly jobs: number;
  readonly runs: FailingHerdRun[];
  /** Median of the runs whose first attempts were all recorded; NaN when none was. */
  readonly medianMs: number;
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
}

/** `runs` failing herds of `jobs` (503 at once, 3 attempts), each on a fresh cluster. */
export async function failingHerd(
  jobs: number,
  runs: number,
  log?: (line: string) => void,
): Promise<FailingHerdResult> {
  const results: FailingHerdRun[] = [];
  for (let i = 1; i <= runs; i++) {
    const run = await failingHerdOnce(jobs, false, {});
    results.push(run);
    log?.(`run ${i}: ${describeRun(run)}`);
  }
  const times = results.flatMap((r) => (r.recordedMs === null ? [] : [r.recordedMs]));
  return {
    jobs,
    runs: results,
    medianMs: times.length > 0 ? median(times) : NaN,
    cpuPerRun: medianCpuPerRun(results.map((r) => r.cpuPerRun)),
  };
}

/** One run's line: when the last first attempt was recorded, and what they were. */
export function describeRun(run: FailingHerdRun): string {
  const outcomes = Object.entries(run.outcomes)
    .map(([outcome, n]) => `${outcome} ${n}`)
    .join(', ');
  const recorded =
    run.recordedMs === null
      ? `not all recorded within ${LIMIT_MS / 1000} s`
      : `last first attempt recorded ${run.recordedMs} ms after due`;
  return `${recorded}; first attempts: ${outcomes}; ${run.logLines} node log lines`;
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      jobs: { type: 'string', default: '10000' },
      runs: { type: 'string', default: '3' },
      refused: { type: 'boolean', default: false },
      attempts: { type: 'string', default: '3' },
      profile: { type: 'string' },
      env: { type: 'string', multiple: true },
    },
  });
  const jobs = Number(values.jobs);
  const kind = values.refused ? 'refused connections' : '503 at once';
  console.log(
    `failing herd: ${jobs} jobs due in one second, target down (${kind}), ${values.attempts} attempts each, 3 nodes, ${machine()}`,
  );
  const times: number[] = [];
  for (let i = 1; i <= Number(values.runs); i++) {
    const run = await failingHerdOnce(
      jobs,
      values.refused,
      envArgs(values.env),
      Number(values.attempts),
      values.profile,
    );
    console.log(`  run ${i}: ${describeRun(run)}`);
    console.log(`    CPU per run (due → last recorded): ${describeCpuPerRun(run.cpuPerRun)}`);
    if (run.recordedMs !== null) times.push(run.recordedMs);
  }
  if (times.length > 0) console.log(`failing herd: median ${median(times)} ms over ${times.length} runs`);
  if (values.profile) console.log(summariseCpuProfiles(values.profile));
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
