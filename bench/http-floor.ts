/**
 * The floor under the lateness figures: the same shape of HTTP traffic without Helios. Three
 * client processes (as 3 nodes) each send rate/3 calls at every whole second, with the workers'
 * own HttpExecutor (keep-alive undici Agent, JSON body, abort timer, excerpt), to the same recording
 * target in this process; lateness = arrival − the whole second. No database, no Kafka: what is
 * left is the cost of a burst of calls on this machine.
 *
 * `--window N` lets each client have at most N calls in flight, as a worker with
 * HELIOS_WORKER_CONCURRENCY=N does: `--rate 10000 --seconds 1 --window 64` (the default) is the herd's floor.
 *
 * The client processes are fresh for each call of httpFloor(), so they warm up first with the
 * same calls as the measured ones (floorShape()): steady bursts with 3 seconds at the full rate,
 * going on at once into the measured seconds; the herd's floor (a window) as the herds are
 * measured (lib/herd-rounds.ts): as many bursts of the same calls as the herds get herds before
 * the measured one (`--warmups`), then, 2 s after the last client finished them, the measured
 * burst, which all three clients start at the same whole second.
 *
 * `--clients N` runs N client processes instead of 3 (1: as the peers' single worker process).
 *
 *   npx tsx bench/http-floor.ts [--rate 500] [--seconds 10] [--window N] [--clients 3] [--warmups N]
 */
import { fork, type ChildProcess } from 'node:child_process';
import { setMaxListeners } from 'node:events';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { DEFAULT_WARMUP_HERDS, HERD_SETTLE_MS, warmupHerds } from './lib/herd-rounds.js';
import { RecordingTarget } from './lib/target.js';
import { deciles, machine, max, ms, percentile } from './lib/stats.js';

/** Steady bursts (no --window): warm-up seconds at the full rate before the measured ones. */
const WARMUP_S = 3;
/** The client is told when the measured seconds start this long before they do, at least. */
const START_NOTICE_MS = 200;

export interface FloorResult {
  readonly rate: number;
  readonly p50: number;
  /** Lateness deciles (stats.ts deciles): where the burst slows down. */
  readonly deciles: string;
  readonly p99: number;
  readonly max: number;
}

/** What a client process does: its warm-up bursts, and the settle before the measured ones. */
export interface FloorShape {
  readonly warmupBursts: number;
  readonly settleMs: number;
}

/**
 * Steady bursts (no window) warm up with WARMUP_S seconds at the full rate and go on at once, as a
 * node under lateness.ts's steady load does; a herd (a window: a burst may take longer than its
 * second) warms up with as many bursts of the same calls as the herds get warm-up herds
 * (`warmups`, lib/herd-rounds.ts), then settles as the herds do.
 */
export function floorShape(window: number, warmups = DEFAULT_WARMUP_HERDS): FloorShape {
  return window === Infinity
    ? { warmupBursts: WARMUP_S, settleMs: 0 }
    : { warmupBursts: warmups, settleMs: HERD_SETTLE_MS };
}

/**
 * One client process: `warmupBursts` bursts of `perSecond` calls a second apart (the warm-up: the
 * same calls as the measured ones), then 'warmed' to the parent, which answers with the instant
 * of the first measured second; then `perSecond` calls at each of `seconds` whole seconds, and exit.
 */
async function client(
  url: string,
  perSecond: number,
  seconds: number,
  window: number,
  warmupBursts: number,
): Promise<void> {
  // The workers' own executor: same undici Agent, handler interface, timer and excerpt reading.
  const { HttpExecutor } = await import('../src/execution/http-executor.js');
  const executor = new HttpExecutor();
  const never = new AbortController().signal;
  // Every call of a burst listens on this one signal (a worker gives each call its own).
  setMaxListeners(0, never);
  const burst = async (name: string, at: number) => {
    // A burst that took longer than a second leaves the next one already due: start it at once.
    await sleep(Math.max(0, at - Date.now()));
    const scheduledFor = new Date(at);
    const call = async (i: number) => {
      const id = `${process.pid}-${name}-${i}`;
      const report = await executor.execute(
        {
          id,
          jobId: 'http-floor',
          attempt: 1,
          scheduledFor,
          target: { url: `${url}/tick`, method: 'POST', headers: {}, body: { bench: true } },
          timeoutMs: 5000,
        },
        never,
      );
      if (report.outcome !== 'succeeded') throw new Error(`call ${id}: ${report.error}`);
    };
    // At most `window` calls in flight: each lane takes the next call when its last one ended.
    let next = 0;
    const lane = async () => {
      while (next < perSecond) await call(next++);
    };
    await Promise.all(Array.from({ length: Math.min(window, perSecond) }, lane));
  };
  const warmupAt = Math.ceil(Date.now() / 1000) * 1000 + 1000;
  for (let s = 0; s < warmupBursts; s++) await burst(`warmup${s}`, warmupAt + s * 1000);
  const started = new Promise<number>((resolve) =>
    process.once('message', (m: { start: number }) => resolve(m.start)),
  );
  process.send!({ type: 'warmed' });
  const first = await started;
  for (let s = 0; s < seconds; s++) await burst(String(s), first + s * 1000);
  await executor.close();
  process.disconnect();
}

/** Resolves when `child` says its warm-up is done; rejects if it exits first. */
function warmed(child: ChildProcess): Promise<void> {
  return new Promise((resolve, reject) => {
    child.once('message', () => resolve());
    child.once('exit', (code) => reject(new Error(`floor client exited (${code}) during its warm-up`)));
  });
}

export async function httpFloor(
  rate: number,
  seconds: number,
  window = Infinity,
  processes = 3,
  warmups = DEFAULT_WARMUP_HERDS,
): Promise<FloorResult> {
  const target = new RecordingTarget();
  await target.start();
  const { warmupBursts, settleMs } = floorShape(window, warmups);
  const self = fileURLToPath(import.meta.url);
  const clients = Array.from({ length: processes }, () =>
    fork(self, [
      '--client',
      target.url,
      String(Math.round(rate / processes)),
      String(seconds),
      String(window),
      String(warmupBursts),
    ]),
  );
  // Listened for from the start: a client that fails during its warm-up exits before it is awaited.
  const exited = clients.map((c) => new Promise<number | null>((resolve) => c.once('exit', resolve)));
  try {
    await Promise.all(clients.map(warmed));
    // One instant for every client, as one due instant for the nodes.
    const first = Math.ceil((Date.now() + settleMs + START_NOTICE_MS) / 1000) * 1000;
    for (const c of clients) c.send({ start: first });
    const codes = await Promise.all(exited);
    if (codes.some((code) => code !== 0)) throw new Error('a floor client failed (its error is above)');
    const lateness = target.lateness(first, Infinity);
    return {
      rate,
      p50: percentile(lateness, 50),
      deciles: deciles(lateness),
      p99: percentile(lateness, 99),
      max: max(lateness),
    };
  } finally {
    for (const c of clients) if (c.exitCode === null && c.signalCode === null) c.kill();
    await target.close();
  }
}

async function main(): Promise<void> {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      client: { type: 'boolean', default: false },
      rate: { type: 'string', multiple: true },
      seconds: { type: 'string', default: '10' },
      window: { type: 'string' },
      clients: { type: 'string', default: '3' },
      warmups: { type: 'string' },
    },
  });
  if (values.client) {
    const [url, perSecond, seconds, window, warmupBursts] = positionals;
    return client(url!, Number(perSecond), Number(seconds), Number(window), Number(warmupBursts));
  }
  const window = values.window === undefined ? Infinity : Number(values.window);
  const processes = Number(values.clients);
  const inFlight = window === Infinity ? '' : `, at most ${window} calls in flight per client`;
  console.log(`HTTP fan-out floor (${processes} client processes → 1 target${inFlight}), ${machine()}`);
  for (const rate of (values.rate ?? ['100', '500', '2000']).map(Number)) {
    const r = await httpFloor(rate, Number(values.seconds), window, processes, warmupHerds(values.warmups));
    console.log(
      `${rate} calls at each whole second: p50 ${ms(r.p50)}  p99 ${ms(r.p99)}  max ${ms(r.max)}  (deciles ${r.deciles} ms)`,
    );
  }
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
