/**
 * The floor under the lateness figures: the same shape of HTTP traffic without Helios. Three
 * client processes (as 3 nodes) each send rate/3 calls at every whole second, with the workers'
 * own HttpExecutor (keep-alive undici Agent, JSON body, abort timer, excerpt), to the same recording
 * target in this process; lateness = arrival − the whole second. No database, no Kafka: what is
 * left is the cost of a burst of calls on this machine.
 *
 * `--window N` lets each client have at most N calls in flight, as a worker with
 * HELIOS_WORKER_CONCURRENCY=N does: `--rate 10000 --seconds 1 --window 64` is the herd's floor.
 *
 *   npx tsx bench/http-floor.ts [--rate 500] [--seconds 10] [--window N]
 */
import { fork } from 'node:child_process';
import { once, setMaxListeners } from 'node:events';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { RecordingTarget } from './lib/target.js';
import { machine, max, ms, percentile } from './lib/stats.js';

const WARMUP_S = 3;

export interface FloorResult {
  readonly rate: number;
  readonly p50: number;
  readonly p99: number;
  readonly max: number;
}

/** One client process: `perSecond` calls at each of `seconds` whole seconds, then exits. */
async function client(url: string, perSecond: number, seconds: number, window: number): Promise<void> {
  // The workers' own executor: same undici Agent, handler interface, timer and excerpt reading.
  const { HttpExecutor } = await import('../src/execution/http-executor.js');
  const executor = new HttpExecutor();
  const never = new AbortController().signal;
  // Every call of a burst listens on this one signal (a worker gives each call its own).
  setMaxListeners(0, never);
  const first = Math.ceil(Date.now() / 1000) * 1000 + 1000;
  for (let s = 0; s < seconds; s++) {
    const at = first + s * 1000;
    // A burst that took longer than a second leaves the next one already due: start it at once.
    await new Promise((resolve) => setTimeout(resolve, Math.max(0, at - Date.now())));
    const scheduledFor = new Date(at);
    // With a window, a warm-up second only opens the window's connections: a herd-sized warm-up
    // would still be running when the measured burst is due.
    const calls = s < WARMUP_S ? Math.min(perSecond, window * 4) : perSecond;
    const call = async (i: number) => {
      const id = `${process.pid}-${s}-${i}`;
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
      while (next < calls) await call(next++);
    };
    await Promise.all(Array.from({ length: Math.min(window, calls) }, lane));
  }
  await executor.close();
}

export async function httpFloor(rate: number, seconds: number, window = Infinity): Promise<FloorResult> {
  const target = new RecordingTarget();
  await target.start();
  try {
    const started = Date.now();
    const self = fileURLToPath(import.meta.url);
    const clients = [0, 1, 2].map(() =>
      fork(self, [
        '--client',
        target.url,
        String(Math.round(rate / 3)),
        String(seconds + WARMUP_S),
        String(window),
      ]),
    );
    await Promise.all(clients.map((c) => once(c, 'exit')));
    const lateness = target.lateness(Math.ceil(started / 1000) * 1000 + (WARMUP_S + 1) * 1000, Infinity);
    return { rate, p50: percentile(lateness, 50), p99: percentile(lateness, 99), max: max(lateness) };
  } finally {
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
    },
  });
  if (values.client) {
    return client(positionals[0]!, Number(positionals[1]), Number(positionals[2]), Number(positionals[3]));
  }
  const window = values.window === undefined ? Infinity : Number(values.window);
  const inFlight = window === Infinity ? '' : `, at most ${window} calls in flight per client`;
  console.log(`HTTP fan-out floor (3 client processes → 1 target${inFlight}), ${machine()}`);
  for (const rate of (values.rate ?? ['100', '500', '2000']).map(Number)) {
    const r = await httpFloor(rate, Number(values.seconds), window);
    console.log(`${rate} calls at each whole second: p50 ${ms(r.p50)}  p99 ${ms(r.p99)}  max ${ms(r.max)}`);
  }
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
