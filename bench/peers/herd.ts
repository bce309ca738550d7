/**
 * Herd benchmark of the peers: on the local PostgreSQL (a fresh database per run), 10,000 items
 * due at the same instant, with pg-boss and graphile-worker. Consumers run in child processes,
 * already polling when the items are inserted (a few seconds before they are due). Two variants:
 * - `http` (the default): each handler makes the HTTP call a Helios worker makes (herd-worker.ts)
 *   to a recording target in this process, the one Helios' herd calls (lib/target.ts); the figure
 *   is due instant → the last call's arrival there, as for Helios;
 * - `--no-http`: the handler only records its start; due instant → every handler had started.
 *
 *   npx tsx bench/peers/herd.ts [--peer pg-boss|graphile-worker] [--runs 3] [--items 10000] [--no-http]
 *                               [--procs 1] [--batch N] [--concurrency N] [--poll MS] [--pool N]
 */
import { cpus } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { createTestDatabase } from '../../test/support/database.js';
import { REPO_ROOT } from '../../test/support/env.js';
import { spawnFixture, stopAll, type ManagedProcess } from '../../test/support/processes.js';
import { CpuMeter, cpuPerRun, describeCpuPerRun, medianCpuPerRun, type CpuCategory } from '../lib/profile.js';
import { machine, max, median, ms, percentile } from '../lib/stats.js';
import { RecordingTarget } from '../lib/target.js';
import { ensurePeersInstalled } from './install.js';
import type { PeerSettings } from './peer.js';
import { peers, type PeerName } from './peers.js';

/**
 * The best settings found for each peer on this 2-core machine (sweep with --batch,
 * --concurrency, --poll, --procs): see the note in bench/README.md.
 */
export const BEST: Record<PeerName, PeerSettings & { procs: number }> = {
  'pg-boss': { batch: 1000, concurrency: 8, pollMs: 500, poolSize: 10, procs: 1 },
  'graphile-worker': { batch: 500, concurrency: 10, pollMs: 100, poolSize: 10, procs: 1 },
};

export interface HerdRun {
  /** Due instant → the last call arrived at the target (http), or the last handler started. */
  readonly lastMs: number;
  readonly firstMs: number;
  readonly p50Ms: number;
  /** Items whose handler started (http: calls that arrived). */
  readonly started: number;
  readonly duplicates: number;
  /** CPU ms per item by process category, from the insert until the last arrival or start. */
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
}

export interface HerdResult {
  readonly peer: PeerName;
  readonly settings: string;
  readonly runs: HerdRun[];
  /** Median over runs of lastMs. */
  readonly medianMs: number;
  /** Whether each handler made the HTTP call. */
  readonly http: boolean;
  /** Median over runs, per category. */
  readonly cpuPerRun: Record<CpuCategory | 'total', number>;
}

interface Options {
  items: number;
  runs: number;
  /** Each handler makes the HTTP call to the recording target (default true). */
  http?: boolean;
  settings: PeerSettings & { procs: number };
  log?: (line: string) => void;
}

type WorkerMessage =
  | { type: 'ready' }
  | { type: 'progress'; count: number }
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

async function herdOnce(peerName: PeerName, options: Options): Promise<HerdRun> {
  const peer = peers[peerName];
  const db = await createTestDatabase({ empty: true });
  const procs: ManagedProcess[] = [];
  const http = options.http ?? true;
  const target = http ? new RecordingTarget() : undefined;
  try {
    const targetUrl = await target?.start();
    await peer.prepare(db.url);
    for (let i = 0; i < options.settings.procs; i++)
      procs.push(worker(peerName, db.url, options.settings, i, targetUrl));
    const counts = procs.map(() => 0);
    procs.forEach((proc, i) =>
      proc.child.on('message', (m: WorkerMessage) => {
        if (m.type === 'progress') counts[i] = m.count;
      }),
    );
    await Promise.all(
      procs.map((p) => nextMessage(p, (m) => (m.type === 'ready' ? true : undefined), 30_000)),
    );
    await sleep(1000); // let the consumers settle into their polling loops

    // Due 5 s from now by the database clock: time enough to insert 10,000 rows first, even on a
    // loaded machine (2.5 s was not, at a load average of 9).
    const { rows } = await db.pool.query<{ at: Date }>(`SELECT now() + interval '5000 milliseconds' AS at`);
    const dueAt = rows[0]!.at;
    for (const p of procs) p.child.send({ type: 'due', at: dueAt.toISOString() });
    await peer.enqueue(db.url, options.items, dueAt);
    const insertedAt = Date.now();
    if (insertedAt >= dueAt.getTime()) throw new Error('inserting the items took longer than the lead time');
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

    const deadline = dueAt.getTime() + 60_000;
    const done = () => (target ? target.count : counts.reduce((a, b) => a + b, 0)) >= options.items;
    while (!done() && Date.now() < deadline) await sleep(20);
    const cpuSample = await cpu.sample(cpus().length);
    const reports = await Promise.all(
      procs.map((p) => {
        const answer = nextMessage(p, (m) => (m.type === 'starts' ? m : undefined), 10_000);
        p.child.send({ type: 'report' });
        return answer;
      }),
    );
    // With HTTP, as for Helios: arrivals at the target; without, the handlers' starts.
    const times = (target ? target.arrivals : reports.flatMap((r) => r.starts)).map(
      (t) => t - dueAt.getTime(),
    );
    const failures = reports.reduce((a, r) => a + r.failures, 0);
    if (failures > 0) console.error(`${peerName}: ${failures} calls answered with an error status`);
    for (const p of procs) p.child.send({ type: 'stop' });
    await Promise.all(procs.map((p) => p.exited));
    return {
      lastMs: times.length >= options.items ? max(times) : NaN,
      firstMs: Math.min(...times),
      p50Ms: percentile(times, 50),
      started: times.length,
      duplicates: reports.reduce((a, r) => a + r.duplicates, 0) + (target?.duplicates ?? 0),
      cpuPerRun: cpuPerRun(cpuSample, options.items),
    };
  } finally {
    await stopAll(procs);
    await target?.close();
    await db.drop();
  }
}

/** Runs the herd `runs` times for one peer; returns every run and the median of the last start. */
export async function herdPeer(peer: PeerName, options: Options): Promise<HerdResult> {
  await ensurePeersInstalled();
  const runs: HerdRun[] = [];
  for (let i = 0; i < options.runs; i++) {
    const run = await herdOnce(peer, options);
    runs.push(run);
    const what = options.http === false ? 'handlers started' : 'HTTP calls arrived';
    options.log?.(
      `${peer} run ${i + 1}: ${run.started} ${what}, last ${ms(run.lastMs)} after due ` +
        `(first ${ms(run.firstMs)}, p50 ${ms(run.p50Ms)}${run.duplicates ? `, ${run.duplicates} duplicates` : ''})`,
    );
    options.log?.(`  CPU per item: ${describeCpuPerRun(run.cpuPerRun)}`);
  }
  const { procs, ...settings } = options.settings;
  const http = options.http ?? true;
  return {
    peer,
    settings:
      `${peers[peer].describe(settings)}; ${procs} process${procs > 1 ? 'es' : ''}` +
      (http
        ? '; each handler makes the HTTP call (undici, keep-alive, 64 sockets per process)'
        : '; no HTTP call'),
    runs,
    medianMs: median(runs.map((r) => r.lastMs)),
    http,
    cpuPerRun: medianCpuPerRun(runs.map((r) => r.cpuPerRun)),
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
      'no-http': { type: 'boolean', default: false },
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
    };
    const result = await herdPeer(name, {
      items: Number(values.items),
      runs: Number(values.runs),
      http: !values['no-http'],
      settings,
      log: (line) => console.log(`  ${line}`),
    });
    console.log(
      `${name}: median ${ms(result.medianMs)} over ${result.runs.length} runs — ${result.settings}`,
    );
  }
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
