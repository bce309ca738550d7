import { graphileWorker } from './graphile-worker.js';
import { pgBoss } from './pg-boss.js';

/** The peers of the herd benchmark, by name. */
export const peers = { 'pg-boss': pgBoss, 'graphile-worker': graphileWorker } as const;
export type PeerName = keyof typeof peers;
