/**
 * A rolling restart at the top of the hour: 10,000 jobs due in one second on 3 fresh nodes, and
 * one worker (not the leader) told to stop (SIGTERM) `--stop-before` ms before the due instant,
 * while it holds the runs it claimed ahead. The jobs have the API's default timeout (30 s), longer
 * than the node's drain (HELIOS_SHUTDOWN_TIMEOUT_MS − 1 s), so the stopping worker calls none of
 * them: it hands each back (re-queued, no attempt used) and announces it to the other workers.
 * Measures the due instant → the last call arrived, how many runs were handed back and how long
 * that took, how late the handed-back runs were called, and duplicates (must be 0).
 * `--stop-before -1` stops no node: the same herd, for comparison.
 *
 * `--signal SIGKILL`: the worker crashes instead (an OOM kill): its claimed runs wait for the reaper.
 *
 *   npm run build && npx tsx bench/stop-in-herd.ts [--jobs 10000] [--runs 1] [--stop-before 300] [--timeout-ms 30000] [--signal SIGTERM] [--env K=V]…
 */
import { cpus } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { envArgs } from './lib/args.js';
import { BenchCluster } from './lib/cluster.js';
import { CpuMeter, cpuPerRun, describeCpuPerRun, type CpuCategory } from './lib/profile.js';
import { machine, max, median, percentile } from './lib/stats.js';

export interface StopInHerdRun {
  /** Due instant → last call arrived, ms; NaN when not every run called within the limit. */
  readonly lastMs: number;
  readonly arrived: number;
  readonly duplicates: number;
  /** Runs the stopping worker handed back uncalled, and the first and last hand-back after due (ms). */
  readonly handedBack: { readonly runs: number; readonly firstMs: number; readonly lastMs: number };
  /** When the handed-back runs' calls began after due (their attempt records), ms: median and last. */
  readonly handedBackCalls: { readonly p50Ms: number; readonly lastMs: number };
  /** SIGTERM → the stopping node's exit, ms (NaN: no node stopped). */
  readonly stopMs: number;
  /** The herd's attempts by outcome and node ('expired': a claim the reaper took back). */
  readonly attempts: Record<string, number>;
  /** Calls that arrived more than 10 s after due. */
  readonly lateCalls: number;
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
}

/** Attempts a stopping worker handed back uncalled (attempt.ts: WorkerStoppingError, whyNotStart). */
const HANDED_BACK = `
  SELECT a.run_id AS "runId", a.finished_at AS at
  FROM run_attempts a JOIN runs r ON r.id = a.run_id
  WHERE r.scheduled_for = $1 AND a.outcome = 'cancelled' AND a.node_id = $2`;

export async function stopInHerdOnce(
  jobs: number,
  stopBeforeMs: number,
  timeoutMs: number,
  env: Record<string, string>,
  signal: NodeJS.Signals = 'SIGTERM',
): Promise<StopInHerdRun> {
  const cluster = await BenchCluster.start({ env });
  try {
    const due = await cluster.nextWholeSecond(9000);
    const schedule = `${due.getUTCSeconds()} ${due.getUTCMinutes()} ${due.getUTCHours()} * * *`;
    await cluster.db.pool.query(
      `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, next_run_at)
       SELECT 'herd-' || n, $1, $2, $3, 3, $4 FROM generate_series(1, $5) AS n`,
      [
        schedule,
        { url: `${cluster.target.url}/tick`, method: 'POST', body: { bench: true } },
        timeoutMs,
        due,
        jobs,
      ],
    );
    const { node: leader } = await cluster.leader();
    const stopping = stopBeforeMs >= 0 ? cluster.nodes.find((n) => n !== leader) : undefined;
    const cpu = new CpuMeter(cluster.cpuGroups());
    let stopMs = NaN;
    if (stopping) {
      await sleep(due.getTime() - stopBeforeMs - Date.now());
      const signalled = Date.now();
      stopping.signal(signal);
      void stopping.exited.then(() => (stopMs = Date.now() - signalled));
    }
    await sleep(due.getTime() - Date.now());
    cpu.restart();
    const deadline = due.getTime() + 60_000;
    while (cluster.target.runsCalledFor(due.getTime()) < jobs && Date.now() < deadline) await sleep(20);
    const sample = await cpu.sample(cpus().length);
    await sleep(1000); // would-be duplicates, and the stopping node's exit
    const arrivals = cluster.target.arrivalsFor(due.getTime()).map((t) => t - due.getTime());
    const complete = cluster.target.runsCalledFor(due.getTime()) >= jobs;
    const handed = stopping
      ? (await cluster.db.pool.query<{ runId: string; at: Date }>(HANDED_BACK, [due, stopping.name])).rows
      : [];
    const handedAt = handed.map((h) => h.at.getTime() - due.getTime());
    // When the other workers' calls of the handed-back runs began (their next attempt's record).
    const { rows: later } = await cluster.db.pool.query<{ at: Date }>(
      `SELECT started_at AS at FROM run_attempts
       WHERE run_id = ANY($1::uuid[]) AND outcome IS DISTINCT FROM 'cancelled'`,
      [handed.map((h) => h.runId)],
    );
    const handedCalls = later.map((r) => r.at.getTime() - due.getTime());
    const { rows: byOutcome } = await cluster.db.pool.query<{ outcome: string; node: string; n: number }>(
      `SELECT coalesce(a.outcome, 'pending') AS outcome, a.node_id AS node, count(*)::int AS n
       FROM run_attempts a JOIN runs r ON r.id = a.run_id WHERE r.scheduled_for = $1 GROUP BY 1, 2 ORDER BY 1, 2`,
      [due],
    );
    return {
      attempts: Object.fromEntries(byOutcome.map((r) => [`${r.outcome}@${r.node}`, r.n])),
      lateCalls: arrivals.filter((t) => t > 10_000).length,
      lastMs: complete ? max(arrivals) : NaN,
      arrived: arrivals.length,
      duplicates: cluster.target.duplicatesFor(due.getTime()),
      handedBack: {
        runs: handed.length,
        firstMs: handed.length ? Math.min(...handedAt) : NaN,
        lastMs: handed.length ? max(handedAt) : NaN,
      },
      handedBackCalls: {
        p50Ms: handedCalls.length ? percentile(handedCalls, 50) : NaN,
        lastMs: handedCalls.length ? max(handedCalls) : NaN,
      },
      stopMs,
      cpuPerRun: cpuPerRun(sample, jobs),
    };
  } finally {
    await cluster.stop();
  }
}

export interface StopInHerdResult {
  readonly jobs: number;
  readonly runs: StopInHerdRun[];
  /** Median of the runs' last calls (NaN when none called every run within the limit). */
  readonly medianMs: number;
}

/** `runs` herds on fresh clusters, one worker stopped 300 ms before each (jobs' timeout 30 s). */
export async function stopInHerd(
  jobs: number,
  runs: number,
  log?: (line: string) => void,
): Promise<StopInHerdResult> {
  const results: StopInHerdRun[] = [];
  for (let i = 1; i <= runs; i++) {
    const run = await stopInHerdOnce(jobs, 300, 30_000, {});
    results.push(run);
    log?.(`run ${i}: ${describeRun(run)}`);
  }
  const times = results.flatMap((r) => (Number.isNaN(r.lastMs) ? [] : [r.lastMs]));
  return { jobs, runs: results, medianMs: times.length > 0 ? median(times) : NaN };
}

export function describeRun(run: StopInHerdRun): string {
  const { handedBack: h, handedBackCalls: c } = run;
  return (
    `last call ${Math.round(run.lastMs)} ms after due (${run.arrived} calls, ${run.duplicates} duplicates); ` +
    `handed back ${h.runs} runs, ${h.firstMs}–${h.lastMs} ms after due, their calls began p50 ${c.p50Ms} / last ` +
    `${c.lastMs} ms after due; the stopping node exited ${run.stopMs} ms after its signal; ` +
    `${run.lateCalls} calls more than 10 s late; attempts ${JSON.stringify(run.attempts)}`
  );
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      jobs: { type: 'string', default: '10000' },
      runs: { type: 'string', default: '1' },
      'stop-before': { type: 'string', default: '300' },
      'timeout-ms': { type: 'string', default: '30000' },
      signal: { type: 'string', default: 'SIGTERM' },
      env: { type: 'string', multiple: true },
    },
  });
  const jobs = Number(values.jobs);
  const stopBefore = Number(values['stop-before']);
  console.log(
    `Stop in a herd: ${jobs} jobs due in one second, 3 nodes, ` +
      (stopBefore >= 0 ? `one worker sent ${values.signal} ${stopBefore} ms before due` : 'no node stopped') +
      `, job timeout ${values['timeout-ms']} ms; ${machine()}`,
  );
  const times: number[] = [];
  for (let i = 1; i <= Number(values.runs); i++) {
    const run = await stopInHerdOnce(
      jobs,
      stopBefore,
      Number(values['timeout-ms']),
      envArgs(values.env),
      values.signal as NodeJS.Signals,
    );
    console.log(`  run ${i}: ${describeRun(run)}`);
    console.log(`    CPU per run (due → last arrival): ${describeCpuPerRun(run.cpuPerRun)}`);
    if (!Number.isNaN(run.lastMs)) times.push(run.lastMs);
  }
  if (times.length > 0)
    console.log(`stop in a herd: median ${Math.round(median(times))} ms over ${times.length} runs`);
}

if (import.meta.url === pathToFileURL(process.argv[1]!).href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
