/**
 * Herd benchmark of the peers: on the local PostgreSQL (a fresh database per run), 10,000 items
 * due at the same instant → time until the handler had started for every one of them, with
 * pg-boss and graphile-worker. Consumers run in child processes, already polling when the items
 * are inserted (a few seconds before they are due); each handler records its start in memory.
 *
 *   npx tsx bench/peers/herd.ts [--peer pg-boss|graphile-worker] [--runs 3] [--items 10000]
 *                               [--procs 1] [--batch N] [--concurrency N] [--poll MS] [--pool N]
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { createTestDatabase } from '../../test/support/database.js';
import { spawnFixture, stopAll, type ManagedProcess } from '../../test/support/processes.js';
import { machine, max, median, ms, percentile } from '../lib/stats.js';
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
  /** Due instant → the last item's handler started. */
  readonly lastMs: number;
  readonly firstMs: number;
  readonly p50Ms: number;
  readonly started: number;
  readonly duplicates: number;
}

export interface HerdResult {
  readonly peer: PeerName;
  readonly settings: string;
  readonly runs: HerdRun[];
  /** Median over runs of lastMs. */
  readonly medianMs: number;
}

interface Options {
  items: number;
  runs: number;
  settings: PeerSettings & { procs: number };
  log?: (line: string) => void;
}

type WorkerMessage =
  | { type: 'ready' }
  | { type: 'progress'; count: number }
  | { type: 'starts'; starts: number[]; duplicates: number };

function worker(peer: PeerName, url: string, settings: PeerSettings, index: number): ManagedProcess {
  return spawnFixture(`${peer}-${index}`, 'bench/peers/herd-worker.ts', {
    PATH: process.env.PATH ?? '',
    HOME: process.env.HOME ?? '/tmp',
    HERD_PEER: peer,
    HERD_URL: url,
    HERD_SETTINGS: JSON.stringify(settings),
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
  try {
    await peer.prepare(db.url);
    for (let i = 0; i < options.settings.procs; i++)
      procs.push(worker(peerName, db.url, options.settings, i));
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

    // Due 2.5 s from now by the database clock: time enough to insert 10,000 rows first.
    const { rows } = await db.pool.query<{ at: Date }>(`SELECT now() + interval '2500 milliseconds' AS at`);
    const dueAt = rows[0]!.at;
    await peer.enqueue(db.url, options.items, dueAt);
    const insertedAt = Date.now();
    if (insertedAt >= dueAt.getTime()) throw new Error('inserting the items took longer than the lead time');

    const deadline = dueAt.getTime() + 60_000;
    while (counts.reduce((a, b) => a + b, 0) < options.items && Date.now() < deadline) await sleep(20);
    const reports = await Promise.all(
      procs.map((p) => {
        const answer = nextMessage(p, (m) => (m.type === 'starts' ? m : undefined), 10_000);
        p.child.send({ type: 'report' });
        return answer;
      }),
    );
    const starts = reports.flatMap((r) => r.starts).map((t) => t - dueAt.getTime());
    for (const p of procs) p.child.send({ type: 'stop' });
    await Promise.all(procs.map((p) => p.exited));
    return {
      lastMs: starts.length >= options.items ? max(starts) : NaN,
      firstMs: Math.min(...starts),
      p50Ms: percentile(starts, 50),
      started: starts.length,
      duplicates: reports.reduce((a, r) => a + r.duplicates, 0),
    };
  } finally {
    await stopAll(procs);
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
    options.log?.(
      `${peer} run ${i + 1}: all ${run.started} started ${ms(run.lastMs)} after due ` +
        `(first ${ms(run.firstMs)}, p50 ${ms(run.p50Ms)}${run.duplicates ? `, ${run.duplicates} duplicates` : ''})`,
    );
  }
  const { procs, ...settings } = options.settings;
  return {
    peer,
    settings: `${peers[peer].describe(settings)}; ${procs} process${procs > 1 ? 'es' : ''}`,
    runs,
    medianMs: median(runs.map((r) => r.lastMs)),
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
