/**
 * Soak: 2,000 every-second jobs (2,000 runs/s offered) on 3 nodes for 15 minutes with a 2-minute
 * retention of runs and outbox rows, so the tables must level off after about 2 minutes instead
 * of growing by 120,000 rows a minute. Every minute it prints the row counts of `runs`,
 * `run_attempts` and `outbox`, their on-disk size (table + indexes + TOAST), the runs/s that
 * reached the target, the queue depth (overdue work anywhere in the pipeline) and each node's RSS.
 * Not a timed test: a benchmark that prints figures (README, Performance).
 *
 *   npm run build && npx tsx bench/soak.ts [--rate 2000] [--minutes 15] [--retention 2m]
 *   npm run bench -- --only soak      # the same, inside the benchmark table (opt-in: 15 minutes)
 */
import { readFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { BenchCluster } from './lib/cluster.js';
import { machine } from './lib/stats.js';

export interface SoakSample {
  readonly minute: number;
  readonly runs: number;
  readonly attempts: number;
  readonly outbox: number;
  /** On-disk size (pg_total_relation_size), MB. */
  readonly runsMb: number;
  readonly attemptsMb: number;
  readonly outboxMb: number;
  /** Calls that reached the target per second over the last minute. */
  readonly completedPerS: number;
  readonly depth: number;
  readonly rssMb: number[];
}

export interface SoakResult {
  readonly rate: number;
  readonly minutes: number;
  readonly retention: string;
  readonly samples: SoakSample[];
  /** Calls that reached the target per second over the whole soak after its first minute. */
  readonly held: number;
  readonly duplicates: number;
}

/** Row counts and sizes of the three tables that grow with every run, in one round trip. */
const TABLES = `
  SELECT (SELECT count(*) FROM runs) AS runs,
         (SELECT count(*) FROM run_attempts) AS attempts,
         (SELECT count(*) FROM outbox) AS outbox,
         pg_total_relation_size('runs') AS runs_bytes,
         pg_total_relation_size('run_attempts') AS attempts_bytes,
         pg_total_relation_size('outbox') AS outbox_bytes,
         (SELECT count(*) FROM jobs WHERE enabled AND next_run_at < now() - interval '1 second')
       + (SELECT count(*) FROM outbox WHERE published_at IS NULL AND publish_after < now() - interval '1 second')
       + (SELECT count(*) FROM runs WHERE state = 'queued' AND not_before < now() - interval '1 second')
         AS depth`;

const mb = (bytes: string) => Number(bytes) / 1024 / 1024;

function rssMb(pid: number): number {
  try {
    const match = /^VmRSS:\s+(\d+) kB/m.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
    return match ? Number(match[1]) / 1024 : NaN;
  } catch {
    return NaN;
  }
}

export function describeSample(s: SoakSample): string {
  return (
    `min ${String(s.minute).padStart(2)}: runs ${s.runs.toLocaleString('en')} (${s.runsMb.toFixed(0)} MB), ` +
    `run_attempts ${s.attempts.toLocaleString('en')} (${s.attemptsMb.toFixed(0)} MB), ` +
    `outbox ${s.outbox.toLocaleString('en')} (${s.outboxMb.toFixed(0)} MB); ` +
    `${s.completedPerS.toFixed(0)} runs/s, depth ${s.depth}, RSS ${s.rssMb.map((r) => r.toFixed(0)).join('/')} MB`
  );
}

export async function soak(options: {
  rate: number;
  minutes: number;
  retention: string;
  log?: (line: string) => void;
}): Promise<SoakResult> {
  const cluster = await BenchCluster.start({
    env: {
      HELIOS_RUN_RETENTION: options.retention,
      HELIOS_OUTBOX_RETENTION: options.retention,
      // Retention, not the per-job floor, is what bounds the tables here (100 per job would keep
      // 200,000 runs of 2,000 jobs whatever their age).
      HELIOS_RUN_KEEP_PER_JOB: '10',
    },
  });
  const samples: SoakSample[] = [];
  try {
    const at = await cluster.nextWholeSecond(2000);
    await cluster.insertJobs(options.rate, '* * * * * *', at, 'soak');
    const start = at.getTime();
    for (let minute = 1; minute <= options.minutes; minute++) {
      await sleep(Math.max(0, start + minute * 60_000 - Date.now()));
      const { rows } = await cluster.db.pool.query<Record<string, string>>(TABLES);
      const r = rows[0]!;
      let arrived = 0;
      const from = start + (minute - 1) * 60_000;
      for (let i = cluster.target.arrivals.length - 1; i >= 0 && cluster.target.arrivals[i]! >= from; i--)
        arrived++;
      const sample: SoakSample = {
        minute,
        runs: Number(r.runs),
        attempts: Number(r.attempts),
        outbox: Number(r.outbox),
        runsMb: mb(r.runs_bytes!),
        attemptsMb: mb(r.attempts_bytes!),
        outboxMb: mb(r.outbox_bytes!),
        completedPerS: arrived / 60,
        depth: Number(r.depth),
        rssMb: cluster.live.map((n) => rssMb(n.pid)),
      };
      samples.push(sample);
      options.log?.(describeSample(sample));
    }
    const after = start + 60_000;
    const end = start + options.minutes * 60_000;
    let arrived = 0;
    for (const t of cluster.target.arrivals) if (t >= after && t < end) arrived++;
    return {
      rate: options.rate,
      minutes: options.minutes,
      retention: options.retention,
      samples,
      held: arrived / ((end - after) / 1000),
      duplicates: cluster.target.duplicates,
    };
  } finally {
    await cluster.stop();
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      rate: { type: 'string', default: '2000' },
      minutes: { type: 'string', default: '15' },
      retention: { type: 'string', default: '2m' },
    },
  });
  console.log(
    `soak: ${values.rate} runs/s on 3 nodes for ${values.minutes} min, retention ${values.retention}, ${machine()}`,
  );
  const result = await soak({
    rate: Number(values.rate),
    minutes: Number(values.minutes),
    retention: values.retention,
    log: (line) => console.log(`  ${line}`),
  });
  console.log(
    `held ${result.held.toFixed(0)} runs/s after the first minute (${result.rate} offered); ${result.duplicates} calls repeated a run id`,
  );
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
