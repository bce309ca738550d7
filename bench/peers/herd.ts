/**
 * Herd benchmark of the peers: on the local PostgreSQL (a fresh database per run), 10,000 items
 * due at the same instant, with pg-boss and graphile-worker. Consumers run in child processes,
 * already polling when the items are inserted (5 s before they are due). Two variants:
 * - `http` (the default): each handler makes the HTTP call a Helios worker makes (herd-worker.ts)
 *   to a recording target in this process, the one Helios' herd calls (lib/target.ts); the figure
 *   is due instant → the last call's arrival there, as for Helios;
 * - `--no-http`: the handler only records its start; due instant → every handler had started.
 *
 * As for Helios (lib/herd-rounds.ts), each run's fresh worker processes get herds of the same
 * size before the measured one: the first (cold, JIT warm-up included) and the second are reported
 * beside the last (warm, inserted 2 s after the one before's last arrival or start, on the same
 * processes and database), the measured figure. The measured herd's items are numbered from
 * `--items` on, the further warm-up herds' from 2 × `--items` on, so each herd's starts, arrivals,
 * duplicates and CPU are its own.
 *
 *   npx tsx bench/peers/herd.ts [--peer pg-boss|graphile-worker] [--runs 3] [--items 10000] [--no-http]
 *                               [--procs 1] [--batch N] [--concurrency N] [--poll MS] [--pool N]
 *                               [--connections N]   (sockets to the target per process; default
 *                                                    HELIOS_WORKER_CONCURRENCY's default)
 *                               [--warmups N]       (herds before the measured one: lib/herd-rounds.ts)
 */
import { cpus } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { DEFAULT_WORKER_CONCURRENCY } from '../../src/config/index.js';
import { createTestDatabase, type TestDatabase } from '../../test/support/database.js';
import { REPO_ROOT } from '../../test/support/env.js';
import { spawnFixture, stopAll, type ManagedProcess } from '../../test/support/processes.js';
import { DEFAULT_WARMUP_HERDS, HERD_SETTLE_MS, warmupHerds } from '../lib/herd-rounds.js';
import { CpuMeter, cpuPerRun, describeCpuPerRun, medianCpuPerRun, type CpuCategory } from '../lib/profile.js';
import { deciles, machine, max, median, ms, percentile } from '../lib/stats.js';
import { RecordingTarget } from '../lib/target.js';
import { ensurePeersInstalled } from './install.js';
import type { PeerSettings } from './peer.js';
import { peers, type PeerName } from './peers.js';

/**
 * The best settings found for each peer on this 2-core machine (sweep with --batch,
 * --concurrency, --poll, --procs): see the note in bench/README.md.
 */
export const BEST: Record<PeerName, PeerSettings & { procs: number }> = {
  'pg-boss': {
    batch: 1000,
    concurrency: 8,
    pollMs: 500,
    poolSize: 10,
    procs: 1,
    connections: DEFAULT_WORKER_CONCURRENCY,
  },
  'graphile-worker': {
    batch: 500,
    concurrency: 10,
    pollMs: 100,
    poolSize: 10,
    procs: 1,
    connections: DEFAULT_WORKER_CONCURRENCY,
  },
};

/** One herd's figures. */
export interface HerdRound {
  /** Due instant → the last call arrived at the target (http), or the last handler started. */
  readonly lastMs: number;
  readonly firstMs: number;
  readonly p50Ms: number;
  /** Arrivals' (or starts') deciles, ms after due (see stats.ts deciles). */
  readonly deciles: string;
  /** Items whose handler started (http: calls that arrived). */
  readonly started: number;
  /** http: calls that repeated an item's run id (as for Helios); else: handlers run again. */
  readonly duplicates: number;
  /** CPU ms per item by process category, from the insert until the last arrival or start. */
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
}

/** One run: the warm herd's figures (the last herd on the same workers), and the cold herd's. */
export interface HerdRun extends HerdRound {
  /** The first herd of the same run, on the then freshly started workers. */
  readonly cold: HerdRound;
  /** The last arrival (or start) of each further warm-up herd (`--warmups`), ms after its due instant. */
  readonly warmupMs: readonly number[];
}

export interface HerdResult {
  readonly peer: PeerName;
  readonly settings: string;
  readonly runs: HerdRun[];
  /** Median over runs of the warm herd's lastMs: the measured figure. */
  readonly medianMs: number;
  /** Median over runs of the cold herd's lastMs. */
  readonly coldMedianMs: number;
  /** Whether each handler made the HTTP call. */
  readonly http: boolean;
  /** Worker processes the peer ran on. */
  readonly procs: number;
  /** Median over runs, per category (warm herd). */
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
  /** The same for the cold herd. */
  readonly coldCpuPerRun: Record<CpuCategory | 'total', number>;
}

interface Options {
  items: number;
  runs: number;
  /** Herds before the measured one, the cold herd included (lib/herd-rounds.ts). */
  warmups?: number;
  /** Each handler makes the HTTP call to the recording target (default true). */
  http?: boolean;
  settings: PeerSettings & { procs: number };
  log?: (line: string) => void;
}

type WorkerMessage =
  | { type: 'ready' }
  | { type: 'progress'; offset: number; count: number }
  | { type: 'starts'; starts: number[]; duplicates: number; failures: number };

function worker(
  peer: PeerName,
  url: string,
  settings: PeerSettings,
  index: number,
  target: string | undefined,
): ManagedProcess {
  return spawnFixture(`${peer}-${index}`, 'bench/peers/herd-worker.ts', {
    PATH: process.env.PATH ?? '',
    HOME: process.env.HOME ?? '/tmp',
    HERD_PEER: peer,
    HERD_URL: url,
    HERD_SETTINGS: JSON.stringify(settings),
    ...(target ? { HERD_TARGET: target } : {}),
  });
}

/** Resolves with the next message of `proc` that `accept` maps to a value. */
function nextMessage<T>(
  proc: ManagedProcess,
  accept: (m: WorkerMessage) => T | undefined,
  timeoutMs: number,
) {
  return new Promise<T>((resolve, reject) => {
    const timer = setTimeout(
      () => done(new Error(`${proc.name}: no answer within ${timeoutMs} ms`)),
      timeoutMs,
    );
    const onMessage = (message: WorkerMessage) => {
      const value = accept(message);
      if (value !== undefined) done(null, value);
    };
    const onExit = () => done(new Error(`${proc.name} exited: ${proc.stderr.join('\n')}`));
    function done(err: Error | null, value?: T) {
      clearTimeout(timer);
      proc.child.off('message', onMessage);
      proc.child.off('exit', onExit);
      if (err) reject(err);
      else resolve(value as T);
    }
    proc.child.on('message', onMessage);
    proc.child.on('exit', onExit);
  });
}

/** The worker processes of one run, on their database, and the target they call (http). */
interface Workers {
  readonly peer: PeerName;
  readonly db: TestDatabase;
  readonly procs: ManagedProcess[];
  readonly target: RecordingTarget | undefined;
  readonly items: number;
  /** The current herd's first item and, per process, how many of its items have started. */
  offset: number;
  readonly counts: number[];
}

/**
 * Starts the worker processes (into `procs`, which the caller stops even if this fails) and
 * resolves once they are polling.
 */
async function startWorkers(
  peerName: PeerName,
  db: TestDatabase,
  target: RecordingTarget | undefined,
  options: Options,
  procs: ManagedProcess[],
): Promise<Workers> {
  const targetUrl = await target?.start();
  await peers[peerName].prepare(db.url);
  const workers: Workers = {
    peer: peerName,
    db,
    procs,
    target,
    items: options.items,
    offset: 0,
    counts: [],
  };
  for (let i = 0; i < options.settings.procs; i++) {
    const proc = worker(peerName, db.url, options.settings, i, targetUrl);
    procs.push(proc);
    workers.counts.push(0);
    proc.child.on('message', (m: WorkerMessage) => {
      // A count sent before the process heard of the current herd is the previous herd's.
      if (m.type === 'progress' && m.offset === workers.offset) workers.counts[i] = m.count;
    });
  }
  await Promise.all(procs.map((p) => nextMessage(p, (m) => (m.type === 'ready' ? true : undefined), 30_000)));
  await sleep(1000); // let the consumers settle into their polling loops
  return workers;
}

/** One herd: items `offset`… inserted, all due at one instant; resolves with its figures. */
async function herdRound(w: Workers, offset: number): Promise<HerdRound> {
  const { db, procs, target, items } = w;
  w.offset = offset;
  w.counts.fill(0);
  // Due 5 s from now by the database clock: time enough to insert 10,000 rows first, even on a
  // loaded machine (2.5 s was not, at a load average of 9).
  const { rows } = await db.pool.query<{ at: Date }>(`SELECT now() + interval '5000 milliseconds' AS at`);
  const dueAt = rows[0]!.at;
  const due = dueAt.getTime();
  for (const p of procs) p.child.send({ type: 'due', at: dueAt.toISOString(), offset });
  await peers[w.peer].enqueue(db.url, items, dueAt, offset);
  if (Date.now() >= due) throw new Error('inserting the items took longer than the lead time');
  const cpu = new CpuMeter({
    named: new Map([
      [process.pid, 'bench (target, sampling)'],
      ...procs.map((p) => [p.pid, `peer ${p.name}`] as const),
    ]),
    repoRoot: REPO_ROOT,
    brokers: false,
    backends: async () => {
      const { rows } = await db.pool.query<{ pid: number }>(
        'SELECT pid FROM pg_stat_activity WHERE datname = $1',
        [db.name],
      );
      return rows.map((r) => r.pid);
    },
  });

  // With HTTP, as for Helios: distinct items whose call arrived; without, whose handler started.
  const arrived = () => (target ? target.runsCalledFor(due) : w.counts.reduce((a, b) => a + b, 0));
  const deadline = due + 60_000;
  while (arrived() < items && Date.now() < deadline) await sleep(20);
  const cpuSample = await cpu.sample(cpus().length);
  const reports = await Promise.all(
    procs.map((p) => {
      const answer = nextMessage(p, (m) => (m.type === 'starts' ? m : undefined), 10_000);
      p.child.send({ type: 'report', from: offset, to: offset + items });
      return answer;
    }),
  );
  const times = (target ? target.arrivalsFor(due) : reports.flatMap((r) => r.starts)).map((t) => t - due);
  // The reports, not the progress counts (sent every 50 ms), say whether every item started.
  const complete = (target ? arrived() : times.length) >= items;
  const failures = reports.reduce((a, r) => a + r.failures, 0);
  if (failures > 0) console.error(`${w.peer}: ${failures} calls answered with an error status`);
  return {
    lastMs: complete ? max(times) : NaN,
    firstMs: Math.min(...times),
    p50Ms: percentile(times, 50),
    deciles: deciles(times),
    started: times.length,
    // An item whose handler ran twice also called twice: count it once, where it is measured.
    duplicates: target ? target.duplicatesFor(due) : reports.reduce((a, r) => a + r.duplicates, 0),
    cpuPerRun: cpuPerRun(cpuSample, items),
  };
}

/**
 * One run on a fresh database and fresh worker processes: a cold herd (items 0…), then, on the
 * same processes, the measured warm herd (items `items`…).
 */
async function herdOnce(peerName: PeerName, options: Options): Promise<HerdRun> {
  const db = await createTestDatabase({ empty: true });
  const target = (options.http ?? true) ? new RecordingTarget() : undefined;
  const procs: ManagedProcess[] = [];
  try {
    const workers = await startWorkers(peerName, db, target, options, procs);
    const cold = await herdRound(workers, 0);
    await sleep(HERD_SETTLE_MS);
    // Further warm-up herds, numbered on after the measured herd's items.
    const warmupMs: number[] = [];
    for (let i = 2; i <= (options.warmups ?? DEFAULT_WARMUP_HERDS); i++) {
      warmupMs.push((await herdRound(workers, i * options.items)).lastMs);
      await sleep(HERD_SETTLE_MS);
    }
    const warm = await herdRound(workers, options.items);
    for (const p of procs) p.child.send({ type: 'stop' });
    await Promise.all(procs.map((p) => p.exited));
    return { ...warm, cold, warmupMs };
  } finally {
    await stopAll(procs);
    await target?.close();
    await db.drop();
  }
}

/**
 * Runs the herd `runs` times for one peer; returns every run and the medians of the warm and the
 * cold herds' last arrival (or start).
 */
export async function herdPeer(peer: PeerName, options: Options): Promise<HerdResult> {
  await ensurePeersInstalled();
  const runs: HerdRun[] = [];
  for (let i = 0; i < options.runs; i++) {
    const run = await herdOnce(peer, options);
    runs.push(run);
    const what = options.http === false ? 'handlers started' : 'HTTP calls arrived';
    const line = (herd: HerdRound) =>
      `${herd.started} ${what}, last ${ms(herd.lastMs)} after due (first ${ms(herd.firstMs)}, ` +
      `p50 ${ms(herd.p50Ms)}${herd.duplicates ? `, ${herd.duplicates} duplicates` : ''}; ` +
      `deciles ${herd.deciles} ms)`;
    options.log?.(`${peer} run ${i + 1}, cold herd (fresh workers): ${line(run.cold)}`);
    options.log?.(`  CPU per item: ${describeCpuPerRun(run.cold.cpuPerRun)}`);
    if (run.warmupMs.length)
      options.log?.(
        `${peer} run ${i + 1}, further warm-up herds: last ${run.warmupMs.map(ms).join(', ')} after due`,
      );
    options.log?.(`${peer} run ${i + 1}, warm herd (same workers): ${line(run)}`);
    options.log?.(`  CPU per item: ${describeCpuPerRun(run.cpuPerRun)}`);
  }
  const { procs, ...settings } = options.settings;
  const http = options.http ?? true;
  return {
    peer,
    settings:
      `${peers[peer].describe(settings)}; ${procs} process${procs > 1 ? 'es' : ''}` +
      (http
        ? `; each handler makes the HTTP call (undici, keep-alive, ${settings.connections} sockets per process)`
        : '; no HTTP call'),
    runs,
    medianMs: median(runs.map((r) => r.lastMs)),
    coldMedianMs: median(runs.map((r) => r.cold.lastMs)),
    http,
    procs,
    cpuPerRun: medianCpuPerRun(runs.map((r) => r.cpuPerRun)),
    coldCpuPerRun: medianCpuPerRun(runs.map((r) => r.cold.cpuPerRun)),
  };
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      peer: { type: 'string', multiple: true },
      runs: { type: 'string', default: '3' },
      items: { type: 'string', default: '10000' },
      procs: { type: 'string' },
      batch: { type: 'string' },
      concurrency: { type: 'string' },
      poll: { type: 'string' },
      pool: { type: 'string' },
      connections: { type: 'string' },
      'no-http': { type: 'boolean', default: false },
      warmups: { type: 'string' },
    },
  });
  const names = (values.peer ?? Object.keys(peers)) as PeerName[];
  console.log(`peer herd: ${values.items} items due at one instant, ${machine()}`);
  for (const name of names) {
    if (!(name in peers)) throw new Error(`unknown peer ${name}`);
    const best = BEST[name];
    const num = (value: string | undefined, fallback: number) =>
      value === undefined ? fallback : Number(value);
    const settings = {
      batch: num(values.batch, best.batch),
      concurrency: num(values.concurrency, best.concurrency),
      pollMs: num(values.poll, best.pollMs),
      poolSize: num(values.pool, best.poolSize),
      procs: num(values.procs, best.procs),
      connections: num(values.connections, best.connections),
    };
    const result = await herdPeer(name, {
      items: Number(values.items),
      runs: Number(values.runs),
      http: !values['no-http'],
      warmups: warmupHerds(values.warmups),
      settings,
      log: (line) => console.log(`  ${line}`),
    });
    console.log(
      `${name}: warm herd median ${ms(result.medianMs)} over ${result.runs.length} runs ` +
        `(cold herd, fresh workers: ${ms(result.coldMedianMs)}) — ${result.settings}`,
    );
  }
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
