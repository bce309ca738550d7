import type { RunMessage } from '../model.js';
import type { Queryable } from './db.js';

/**
 * The channel on which a stopping worker hands the announcements it will not call to the other
 * workers. Its own Kafka partitions stay with it while it restarts (static membership), so without
 * this the runs it held wait for the others' polling fallback (`HELIOS_POLL_OVERDUE_MS` late).
 */
export const HANDOFF_CHANNEL = 'helios_handoff';

/** The live workers a hand-off may go to: every node with the worker role but `but` (null: none left out). */
export function workersBut(
  nodes: readonly { readonly id: string; readonly roles: readonly string[] }[],
  but: string | null,
): string[] {
  return nodes.filter((n) => n.id !== but && n.roles.includes('worker')).map((n) => n.id);
}

/**
 * The peers `list` names, or none (every worker receives the hand-off) when it cannot say: a hint
 * sent to all is worth more than one not sent. `onError` hears why.
 */
export async function peersOrEveryone(
  list: () => Promise<readonly string[]>,
  onError: (err: unknown) => void,
): Promise<readonly string[]> {
  try {
    return await list();
  } catch (err) {
    onError(err);
    return [];
  }
}

/** NOTIFY payloads must stay under 8000 bytes; a message is about 200 (ASCII: UUIDs, ISO dates, numbers). */
const MAX_PAYLOAD_BYTES = 7000;

/** One NOTIFY per payload, in one statement. $1 = payloads (JSON: { to?, runs: run messages }). */
const NOTIFY = `SELECT pg_notify('${HANDOFF_CHANNEL}', payload) FROM unnest($1::text[]) AS payload`;

/**
 * Announces `messages` to the workers listening on {@link HANDOFF_CHANNEL}: each to one of `peers`
 * in turn (its payload names it in `to`; the others ignore it), or to every worker when no peer is
 * known. Only a hint: a receiver holds them like Kafka announcements, the claim in PostgreSQL
 * decides who runs one, and a run whose receiver missed it is still queued for the polling
 * fallback. Addressing keeps a cluster of N workers from making N − 1 claims of each run.
 * Returns the number of notifications sent.
 */
export async function handOffRuns(
  db: Queryable,
  messages: readonly RunMessage[],
  peers: readonly string[] = [],
): Promise<number> {
  const byPeer = new Map<string | undefined, RunMessage[]>();
  messages.forEach((message, i) => {
    const to = peers.length > 0 ? peers[i % peers.length] : undefined;
    const batch = byPeer.get(to);
    if (batch) batch.push(message);
    else byPeer.set(to, [message]);
  });
  const payloads: string[] = [];
  for (const [to, batch] of byPeer) {
    const head = to === undefined ? '{"runs":[' : `{"to":${JSON.stringify(to)},"runs":[`;
    let chunk: string[] = [];
    let bytes = head.length + 2;
    const flush = () => {
      if (chunk.length > 0) payloads.push(`${head}${chunk.join(',')}]}`);
      chunk = [];
      bytes = head.length + 2;
    };
    for (const message of batch) {
      const text = JSON.stringify(message);
      if (chunk.length > 0 && bytes + Buffer.byteLength(text) + 1 > MAX_PAYLOAD_BYTES) flush();
      chunk.push(text);
      bytes += Buffer.byteLength(text) + 1;
    }
    flush();
  }
  if (payloads.length > 0) await db.query(NOTIFY, [payloads]);
  return payloads.length;
}
