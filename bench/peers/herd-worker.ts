/**
 * One consuming process of the peer herd benchmark (started by herd.ts with an IPC channel).
 * Records, in memory, when the handler ran for each item and reports it when asked.
 */
import { nowMs } from '../lib/stats.js';
import { peers } from './peers.js';
import type { PeerSettings } from './peer.js';

type Command = { type: 'report' } | { type: 'stop' };

const send = (message: unknown) => process.send!(message);
const peer = peers[process.env.HERD_PEER as keyof typeof peers];
const settings = JSON.parse(process.env.HERD_SETTINGS!) as PeerSettings;
const starts = new Map<number, number>();
let duplicates = 0;

const stop = await peer.work(process.env.HERD_URL!, settings, (n) => {
  if (starts.has(n)) duplicates++;
  else starts.set(n, nowMs());
});
const progress = setInterval(() => send({ type: 'progress', count: starts.size }), 50);
send({ type: 'ready' });

process.on('message', (command: Command) => {
  if (command.type === 'report') send({ type: 'starts', starts: [...starts.values()], duplicates });
  if (command.type === 'stop') {
    clearInterval(progress);
    void stop()
      .catch((err: unknown) => console.error('stopping the peer failed:', err))
      .finally(() => process.disconnect());
  }
});
