/**
 * One consuming process of the peer herd benchmark (started by herd.ts with an IPC channel).
 * Records, in memory, when the handler ran for each item and reports it when asked. With
 * HERD_TARGET set, each handler also makes the HTTP call a Helios worker makes for a herd job (the
 * same method, path, headers and body, to the same recording target) through undici with
 * keep-alive, and the item ends when the response has been read; the figure is then the last
 * call's arrival at the target, measured by herd.ts as for Helios.
 */
import { Agent } from 'undici';
import { peerCall } from '../lib/peer-call.js';
import { nowMs } from '../lib/stats.js';
import { peers } from './peers.js';
import type { PeerSettings } from './peer.js';

type Command = { type: 'due'; at: string } | { type: 'report' } | { type: 'stop' };

/**
 * Keep-alive sockets to the target at most, per process: the default concurrency of one Helios
 * worker (HELIOS_WORKER_CONCURRENCY 64). Calls beyond it wait in undici's queue for a socket.
 */
const CONNECTIONS = 64;

const send = (message: unknown) => process.send!(message);
const peer = peers[process.env.HERD_PEER as keyof typeof peers];
const settings = JSON.parse(process.env.HERD_SETTINGS!) as PeerSettings;
const target = process.env.HERD_TARGET;
/** X-Helios-Scheduled-For of the calls: the items' due instant, sent by herd.ts before the insert. */
let scheduledFor = new Date().toISOString();
const starts = new Map<number, number>();
let duplicates = 0;
let failures = 0;

// undici's defaults otherwise, as the Helios executor: keep-alive 4 s, HTTP/1.1.
const agent = new Agent({ connections: CONNECTIONS, keepAliveTimeout: 4_000, allowH2: false });

/** The call a Helios worker makes for a herd job (lib/peer-call.ts). */
async function call(n: number): Promise<void> {
  const status = await peerCall(agent, target!, `peer-${n}`, scheduledFor);
  if (status < 200 || status >= 300) {
    failures++;
    throw new Error(`HTTP ${status}`);
  }
}

const stop = await peer.work(process.env.HERD_URL!, settings, async (n) => {
  if (starts.has(n)) duplicates++;
  else starts.set(n, nowMs());
  if (target) await call(n);
});
const progress = setInterval(() => send({ type: 'progress', count: starts.size }), 50);
send({ type: 'ready' });

process.on('message', (command: Command) => {
  if (command.type === 'due') scheduledFor = command.at;
  if (command.type === 'report') send({ type: 'starts', starts: [...starts.values()], duplicates, failures });
  if (command.type === 'stop') {
    clearInterval(progress);
    void stop()
      .then(() => agent.close())
      .catch((err: unknown) => console.error('stopping the peer failed:', err))
      .finally(() => process.disconnect());
  }
});
