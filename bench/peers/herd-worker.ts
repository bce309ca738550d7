/**
 * One consuming process of the peer herd benchmark (started by herd.ts with an IPC channel). It
 * serves the herds of a run, cold first, warm last (lib/herd-rounds.ts); each 'due' command announces a herd whose
 * items are numbered from its offset. Records, in memory, when the handler ran for each item and
 * reports the starts of one herd's items when asked. With HERD_TARGET set, each handler also makes
 * the HTTP call a Helios worker makes for a herd job (the same method, path, headers and body, to
 * the same recording target) through undici with keep-alive, and the item ends when the response
 * has been read; the figure is then the last call's arrival at the target, measured by herd.ts as
 * for Helios.
 */
import { Agent } from 'undici';
import { peerCall } from '../lib/peer-call.js';
import { nowMs } from '../lib/stats.js';
import { peers } from './peers.js';
import type { PeerSettings } from './peer.js';

type Command =
  /** A herd due `at`, items numbered from `offset`: sent before its items are inserted. */
  | { type: 'due'; at: string; offset: number }
  /** The starts, repeats and failed calls of items `from`…`to − 1`. */
  | { type: 'report'; from: number; to: number }
  | { type: 'stop' };

const send = (message: unknown) => process.send!(message);
const peer = peers[process.env.HERD_PEER as keyof typeof peers];
const settings = JSON.parse(process.env.HERD_SETTINGS!) as PeerSettings;
/**
 * Keep-alive sockets to the target at most, per process: by default the calls one Helios worker
 * makes at once (HELIOS_WORKER_CONCURRENCY's default; BEST in herd.ts). Calls beyond it wait in undici's queue for a
 * socket. Neither peer's warm herd moved with 128 sockets instead of 64 (`--connections`, 3
 * interleaved pairs: pg-boss 1.04 / 1.00 / 1.05 s against 1.02 / 1.17 / 1.08 s; graphile-worker
 * 1.23 / 1.09 / 1.24 s against 1.10 / 6.71 (a stall in its polling) / 1.04 s).
 */
const CONNECTIONS = settings.connections;
const target = process.env.HERD_TARGET;
/** X-Helios-Scheduled-For of the calls: the items' due instant, sent by herd.ts before the insert. */
let scheduledFor = new Date().toISOString();
/** The current herd's first item, and how many of its items have started (the progress figure). */
let offset = 0;
let herdStarted = 0;
const starts = new Map<number, number>();
/** Per item, how many times its handler ran again after the first. */
const repeats = new Map<number, number>();
/** Items whose call was answered with an error status (once per answer). */
const failed: number[] = [];

// undici's defaults otherwise, as the Helios executor: keep-alive 4 s, HTTP/1.1.
const agent = new Agent({ connections: CONNECTIONS, keepAliveTimeout: 4_000, allowH2: false });

/** The call a Helios worker makes for a herd job (lib/peer-call.ts). */
async function call(n: number): Promise<void> {
  const status = await peerCall(agent, target!, `peer-${n}`, scheduledFor);
  if (status < 200 || status >= 300) {
    failed.push(n);
    throw new Error(`HTTP ${status}`);
  }
}

const stop = await peer.work(process.env.HERD_URL!, settings, async (n) => {
  if (starts.has(n)) repeats.set(n, (repeats.get(n) ?? 0) + 1);
  else {
    starts.set(n, nowMs());
    if (n >= offset) herdStarted++;
  }
  if (target) await call(n);
});
// With the herd's offset, so that herd.ts can drop a count of the previous herd still in flight.
const progress = setInterval(() => send({ type: 'progress', offset, count: herdStarted }), 50);
send({ type: 'ready' });

process.on('message', (command: Command) => {
  if (command.type === 'due') {
    scheduledFor = command.at;
    offset = command.offset;
    herdStarted = 0; // its items are inserted after this command: none has started
  }
  if (command.type === 'report') {
    const { from, to } = command;
    const inHerd = (n: number) => n >= from && n < to;
    send({
      type: 'starts',
      starts: [...starts].filter(([n]) => inHerd(n)).map(([, at]) => at),
      duplicates: [...repeats].filter(([n]) => inHerd(n)).reduce((sum, [, times]) => sum + times, 0),
      failures: failed.filter(inHerd).length,
    });
  }
  if (command.type === 'stop') {
    clearInterval(progress);
    void stop()
      .then(() => agent.close())
      .catch((err: unknown) => console.error('stopping the peer failed:', err))
      .finally(() => process.disconnect());
  }
});
