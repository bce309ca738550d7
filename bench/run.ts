/**
 * All the benchmarks, one after the other, then one table: herd (Helios and, on the same
 * PostgreSQL, pg-boss and graphile-worker, as ratios), lateness at 100/500/2,000 runs/s (with the
 * floor: the same bursts of HTTP calls without Helios), sustained throughput, failover, memory. Needs the local servers (`npm run infra -- up`).
 *
 * The herd rows give the warm herd as the headline: each contender's freshly started processes get
 * a first herd (cold, JIT warm-up included), a second, and then the measured third one on the same
 * processes (lib/herd-rounds.ts; `--warmups N` for another count); the cold and the second herds'
 * figures are in the same cell, and the ratios are of warm figures. `--json` holds them all
 * (medianMs: warm, coldMedianMs: cold, and each run's `cold` and `warmupMs`).
 *
 *   npm run bench                     # full: medians of 3 runs, about 25 minutes
 *   npm run bench -- --quick          # one run each, shorter windows, about 8 minutes
 *   npm run bench -- --only herd,peers --json results.json
 *   npm run bench -- --only soak      # the soak (15 minutes at 2,000 runs/s): opt-in, not in the default set
 *   npm run bench -- --warmups 1      # every herd contender measured on its second herd, as until 2026-12-07
 */
import { writeFileSync } from 'node:fs';
import { loadavg } from 'node:os';
import { parseArgs } from 'node:util';
import { DEFAULT_WORKER_CONCURRENCY } from '../src/config/index.js';
import { failingHerd, type FailingHerdResult } from './failing-herd.js';
import { stopInHerd, type StopInHerdResult } from './stop-in-herd.js';
import { failover, type FailoverResult } from './failover.js';
import { herd, type HerdResult } from './herd.js';
import { httpFloor, type FloorResult } from './http-floor.js';
import { lateness, type LatenessResult } from './lateness.js';
import { BENCH_NODES as HELIOS_NODES } from './lib/cluster.js';
import { warmupHerds } from './lib/herd-rounds.js';
import { CPU_CATEGORIES, type CpuCategory } from './lib/profile.js';
import { machine, max, median, ms, table } from './lib/stats.js';
import { memory, type MemoryResult } from './memory.js';
import { BEST, herdPeer, type HerdResult as PeerHerdResult } from './peers/herd.js';
import type { PeerName } from './peers/peers.js';
import { describeSample, soak, type SoakResult } from './soak.js';
import { throughput, type ThroughputResult } from './throughput.js';

const PARTS = [
  'peers',
  'herd',
  'failing',
  'stop',
  'lateness',
  'floor',
  'throughput',
  'failover',
  'memory',
  'soak',
] as const;
type Part = (typeof PARTS)[number];
/** Run without --only. The soak takes 15 minutes on its own: only when asked for. */
const DEFAULT_PARTS = PARTS.filter((p) => p !== 'soak');

interface Results {
  machine: string;
  loadAtStart: number[];
  quick: boolean;
  /** Herds (the floor: bursts) each herd contender's fresh processes got before the measured one. */
  warmups: number;
  /** Each peer twice: each handler making the HTTP call (http: true), and without it. */
  peers?: PeerHerdResult[];
  herd?: HerdResult;
  /** A herd whose target answers 503: due → every first attempt recorded. */
  failing?: FailingHerdResult;
  /** A worker stopped 300 ms before a herd (a rolling restart): due → last call arrived. */
  stop?: StopInHerdResult;
  lateness?: LatenessResult[];
  floor?: FloorResult[];
  /** The herd's 10,000 calls without Helios, as many in flight per client process as a worker's default. */
  herdFloor?: FloorResult[];
  throughput?: ThroughputResult;
  failover?: FailoverResult;
  memory?: MemoryResult;
  soak?: SoakResult;
}

const log = (line: string) => console.log(`  ${line}`);
const seconds = (value: number) => (Number.isFinite(value) ? `${(value / 1000).toFixed(2)} s` : 'n/a');

/** "nodes 0.55 / postgresql 0.27 / … = 0.93": CPU ms per run by category, our processes summed. */
function cpuCell(perRun: Record<CpuCategory | 'total', number>): string {
  const parts = CPU_CATEGORIES.filter((c) => c !== 'other' && perRun[c] > 0).map(
    (c) => `${c} ${perRun[c].toFixed(3)}`,
  );
  return `${parts.join(' / ')} = ${perRun.total.toFixed(3)} ms (else on the machine ${perRun.other.toFixed(3)})`;
}

/** "a cold herd", "a cold herd and 1 more" (lib/herd-rounds.ts). */
function herdsBefore(warmups: number): string {
  return warmups > 1 ? `a cold herd and ${warmups - 1} more` : 'a cold herd';
}

function summary(r: Results): string {
  const rows: string[][] = [['figure', 'measured', 'target (goal)']];
  const runs = (n: number) => (n > 1 ? ` (median of ${n})` : '');
  // The measured (warm) herd in bold; beside it the second herd (with --warmups 2 or more: the one
  // measured before) and the cold one (the first herd on fresh processes).
  const warmCold = (result: {
    medianMs: number;
    coldMedianMs: number;
    runs: readonly { warmupMs: readonly number[] }[];
  }) => {
    const second = result.runs.every((run) => run.warmupMs.length > 0)
      ? `; second herd ${seconds(median(result.runs.map((run) => run.warmupMs[0]!)))}`
      : '';
    return (
      `**${seconds(result.medianMs)}** warm${runs(result.runs.length)}${second}; ` +
      `cold (fresh processes) ${seconds(result.coldMedianMs)}`
    );
  };
  if (r.herd) {
    rows.push([
      `herd: ${r.herd.jobs.toLocaleString('en')} jobs due in one second → last call`,
      warmCold(r.herd),
      '≤ 1.0 s, and ahead of every peer making the same call',
    ]);
    rows.push(['  CPU per run, warm herd (insert → last call)', cpuCell(r.herd.cpuPerRun), '≤ 0.2 ms']);
    rows.push([
      '    of which from the due instant on (start, call, completion) until the last call',
      cpuCell(r.herd.afterDueCpuPerRun),
      '',
    ]);
    rows.push([
      '    from the due instant on until the last run was recorded finished',
      `${cpuCell(r.herd.recordedCpuPerRun)}; last recorded ${seconds(median(r.herd.runs.map((h) => h.recordedMs)))}`,
      '',
    ]);
    rows.push(['    the cold herd, from the due instant on', cpuCell(r.herd.coldAfterDueCpuPerRun), '']);
  }
  if (r.herdFloor?.length) {
    rows.push([
      `  floor: the same 10,000 calls without Helios, ${DEFAULT_WORKER_CONCURRENCY} in flight per process, after ${r.warmups === 1 ? 'one burst' : `${r.warmups} bursts`} of them → last call`,
      `${seconds(median(r.herdFloor.map((f) => f.max)))}${runs(r.herdFloor.length)}`,
      '',
    ]);
  }
  /** "; pg-boss/Helios = 0.91 (warm)", or '' when either warm herd has no figure. */
  const toHelios = (peer: PeerHerdResult) =>
    r.herd && Number.isFinite(peer.medianMs)
      ? `; ${peer.peer}/Helios = ${(peer.medianMs / r.herd.medianMs).toFixed(2)} (warm)`
      : '';
  for (const peer of (r.peers ?? []).filter((p) => p.http && p.procs === BEST[p.peer].procs)) {
    const ratio =
      toHelios(peer) ||
      `; arrived within 60 s (warm): ${peer.runs.map((run) => run.started).join(', ')} of 10,000`;
    const bare = r.peers?.find((p) => p.peer === peer.peer && !p.http);
    rows.push([
      `  same herd, ${peer.peer}, same HTTP call → last call`,
      `${warmCold(peer)}${ratio}` +
        (bare
          ? ` | no HTTP, all started: ${seconds(bare.medianMs)} warm, ${seconds(bare.coldMedianMs)} cold`
          : ''),
      '',
    ]);
    rows.push([`    CPU per run, ${peer.peer} with HTTP, warm herd`, cpuCell(peer.cpuPerRun), '']);
  }
  // Helios runs 3 nodes on the 2 cores; a peer's best is one process. The same herd with as many
  // processes as Helios has nodes shows what the third process costs each of them.
  for (const peer of (r.peers ?? []).filter((p) => p.http && p.procs === HELIOS_NODES)) {
    rows.push([
      `  same herd, ${peer.peer} on ${HELIOS_NODES} processes (as Helios's nodes), same HTTP call → last call`,
      `${warmCold(peer)}${toHelios(peer)}; CPU per run ${cpuCell(peer.cpuPerRun)}`,
      '',
    ]);
  }
  for (const peer of (r.peers ?? []).filter(
    (p) => !p.http && !r.peers?.some((q) => q.http && q.peer === p.peer),
  )) {
    rows.push([`  same herd, ${peer.peer}, no HTTP → all started`, warmCold(peer), '']);
  }
  for (const l of r.lateness ?? []) {
    const target = l.rate === 500 ? 'p99 ≤ floor p99 + 5 ms' : '';
    rows.push([
      `lateness at ${l.rate} runs/s: p50 / p99 / max`,
      `${ms(l.p50)} / ${ms(l.p99)} / ${ms(l.max)}${runs(l.runs.length)}`,
      target,
    ]);
    rows.push([`  CPU per run at ${l.rate} runs/s`, cpuCell(l.cpuPerRun), '≤ 0.2 ms']);
    const floor = r.floor?.find((f) => f.rate === l.rate);
    if (floor)
      rows.push([
        `  floor: the same calls without Helios`,
        `${ms(floor.p50)} / ${ms(floor.p99)} / ${ms(floor.max)}`,
        '',
      ]);
  }
  if (r.throughput) {
    const best = r.throughput.hold ?? r.throughput.steps.filter((s) => s.sustained).at(-1);
    const failed = r.throughput.steps.find((s) => !s.sustained);
    rows.push([
      'sustained throughput (queue depth bounded)',
      best
        ? `${best.completed.toFixed(0)} runs/s of ${best.offered} offered for ${best.seconds} s, depth max ${best.maxDepth}, ` +
          `calls' median lateness ${ms(best.lateness.first)} → ${ms(best.lateness.last)}` +
          (failed
            ? `; ${failed.offered}/s offered → ${failed.completed.toFixed(0)}/s, depth ${failed.endDepth}`
            : '')
        : 'none sustained',
      '≥ 5,000 runs/s',
    ]);
  }
  if (r.failing) {
    const outcomes = r.failing.runs.map((run) => run.outcomes.failed ?? 0);
    rows.push([
      `herd, target down (503): ${r.failing.jobs.toLocaleString('en')} due → every first attempt recorded`,
      `${seconds(r.failing.medianMs)} (${r.failing.runs.map((run) => seconds(run.recordedMs ?? NaN)).join(', ')}); ` +
        `first attempts recorded failed: ${outcomes.join(' / ')}; CPU per run ${cpuCell(r.failing.cpuPerRun)}`,
      '—',
    ]);
  }
  if (r.stop) {
    const handed = r.stop.runs.map((run) => run.handedBack.runs);
    const duplicates = r.stop.runs.reduce((n, run) => n + run.duplicates, 0);
    rows.push([
      `herd with a worker stopped 300 ms before due (a rolling restart): ${r.stop.jobs.toLocaleString('en')} due → last call arrived`,
      `${seconds(r.stop.medianMs)} (${r.stop.runs.map((run) => seconds(run.lastMs)).join(', ')}); ` +
        `handed back ${handed.join(' / ')}; duplicates ${duplicates}`,
      '—',
    ]);
  }
  if (r.failover) {
    rows.push([
      `failover: kill -9 leader → first dispatch (${r.failover.tries.length} tries)`,
      `median ${ms(r.failover.median)}, max ${ms(r.failover.max)} (key deleted: max ${ms(max(r.failover.keyDeleted))})`,
      'max ≤ 3.5 s',
    ]);
  }
  if (r.memory) {
    rows.push([
      `memory: peak RSS per node, ${r.memory.jobs.toLocaleString('en')} jobs defined`,
      r.memory.nodes.map((n) => `${n.peakMb.toFixed(0)} MB`).join(' / '),
      '≤ 120 MB',
    ]);
  }
  if (r.soak) {
    const last = r.soak.samples.at(-1);
    rows.push([
      `soak: ${r.soak.rate} runs/s offered for ${r.soak.minutes} min, retention ${r.soak.retention}`,
      `held ${r.soak.held.toFixed(0)} runs/s` +
        (last
          ? `; at the end runs ${last.runs.toLocaleString('en')} (${last.runsMb.toFixed(0)} MB), ` +
            `attempts ${last.attempts.toLocaleString('en')} (${last.attemptsMb.toFixed(0)} MB), ` +
            `outbox ${last.outbox.toLocaleString('en')} (${last.outboxMb.toFixed(0)} MB)`
          : ''),
      'tables level off',
    ]);
  }
  return table(rows);
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      quick: { type: 'boolean', default: false },
      only: { type: 'string' },
      json: { type: 'string' },
      warmups: { type: 'string' },
    },
  });
  const quick = values.quick!;
  const parts = new Set((values.only?.split(',') ?? DEFAULT_PARTS) as Part[]);
  for (const part of parts)
    if (!PARTS.includes(part)) throw new Error(`unknown part ${part} (${PARTS.join(', ')})`);
  const warmups = warmupHerds(values.warmups);
  const results: Results = { machine: machine(), loadAtStart: loadavg(), quick, warmups };
  console.log(
    `Helios benchmarks${quick ? ' (quick)' : ''}: ${results.machine}, load average ${loadavg()
      .map((l) => l.toFixed(2))
      .join(' ')}`,
  );
  const herdRuns = quick ? 1 : 3;

  if (parts.has('peers')) {
    console.log(
      '\npeers: 10,000 items due at one instant, each run on a fresh database on the same PostgreSQL ' +
        `(${herdsBefore(warmups)}, then the measured warm herd, on the same worker processes)`,
    );
    results.peers = [];
    // Each peer at its best settings with and without the call, then with the call on as many
    // processes as Helios has nodes.
    const variants = [
      { http: true, procs: undefined },
      { http: false, procs: undefined },
      { http: true, procs: HELIOS_NODES },
    ];
    for (const { http, procs } of variants) {
      for (const peer of Object.keys(BEST) as PeerName[]) {
        const result = await herdPeer(peer, {
          items: 10_000,
          runs: herdRuns,
          warmups,
          http,
          settings: { ...BEST[peer], procs: procs ?? BEST[peer].procs },
          log,
        });
        log(`${peer} settings: ${result.settings}`);
        results.peers.push(result);
      }
    }
  }
  if (parts.has('herd')) {
    console.log(
      `\nHelios herd: 10,000 jobs due in one second, 3 nodes (${herdsBefore(warmups)}, then the measured warm herd, ` +
        'on each fresh cluster)',
    );
    results.herd = await herd(10_000, { runs: herdRuns, warmups, log });
  }
  if (parts.has('failing')) {
    console.log('\nherd whose target is down: 10,000 jobs due in one second, every call answered 503');
    results.failing = await failingHerd(10_000, herdRuns, log);
    log(`median ${seconds(results.failing.medianMs)}`);
  }
  if (parts.has('stop')) {
    console.log('\nherd with a worker stopped 300 ms before due: 10,000 jobs, 30 s timeouts');
    results.stop = await stopInHerd(10_000, herdRuns, log);
    log(`median ${seconds(results.stop.medianMs)}`);
  }
  if (parts.has('lateness')) {
    console.log('\nlateness at steady load, 3 nodes (arrival at the target − X-Helios-Scheduled-For)');
    results.lateness = [];
    for (const rate of [100, 500, 2000]) {
      results.lateness.push(await lateness(rate, { seconds: quick ? 15 : 30, runs: quick ? 1 : 3, log }));
    }
  }
  if (parts.has('floor')) {
    console.log(
      '\nfloor: the same bursts of HTTP calls without Helios (3 undici client processes → the target)',
    );
    results.floor = [];
    for (const rate of [100, 500, 2000]) {
      const floor = await httpFloor(rate, quick ? 5 : 10);
      log(
        `${rate} calls at each whole second: p50 ${ms(floor.p50)}  p99 ${ms(floor.p99)}  max ${ms(floor.max)}`,
      );
      results.floor.push(floor);
    }
    // The herd's shape: 10,000 calls due at once, at most HELIOS_WORKER_CONCURRENCY (its default) in
    // flight per process, as three workers make them; after as many bursts of the same calls as the
    // herds get herds before the measured one.
    results.herdFloor = [];
    for (let i = 0; i < herdRuns; i++) {
      const floor = await httpFloor(10_000, 1, DEFAULT_WORKER_CONCURRENCY, undefined, warmups);
      log(
        `10000 calls at once, ${DEFAULT_WORKER_CONCURRENCY} in flight per process, after ${warmups} burst(s) of them: last ${ms(floor.max)} ` +
          `after due (p50 ${ms(floor.p50)})`,
      );
      results.herdFloor.push(floor);
    }
  }
  if (parts.has('throughput')) {
    console.log('\nsustained throughput, 3 nodes');
    results.throughput = await throughput({
      steps: quick ? [1000, 2000] : [1000, 1500, 2000, 2500, 3000, 4000, 5000],
      stepSeconds: quick ? 15 : 20,
      holdSeconds: quick ? 20 : 60,
      log,
    });
  }
  if (parts.has('failover')) {
    console.log('\nfailover: kill -9 of the leader → first dispatch by the new leader');
    results.failover = await failover(quick ? 3 : 10, log);
  }
  if (parts.has('memory')) {
    console.log('\nmemory: 3 nodes, 10,000 jobs defined (each fires once a minute)');
    results.memory = await memory(10_000, quick ? 35 : 65);
    for (const n of results.memory.nodes)
      log(`${n.name}: peak RSS ${n.peakMb.toFixed(0)} MB, now ${n.rssMb.toFixed(0)} MB`);
  }
  if (parts.has('soak')) {
    const minutes = quick ? 5 : 15;
    console.log(
      `\nsoak: 2,000 runs/s on 3 nodes for ${minutes} min, 2-minute retention (tables each minute)`,
    );
    results.soak = await soak({ rate: 2000, minutes, retention: '2m', log });
    log(`held ${results.soak.held.toFixed(0)} runs/s; last: ${describeSample(results.soak.samples.at(-1)!)}`);
  }

  console.log(
    `\n${results.machine}; load average at start ${results.loadAtStart.map((l) => l.toFixed(2)).join(' ')}`,
  );
  console.log(summary(results));
  if (values.json) writeFileSync(values.json, `${JSON.stringify(results, null, 2)}\n`);
}

main().catch((err: unknown) => {
  console.error(err);
  process.exitCode = 1;
});
