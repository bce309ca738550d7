import type { RunMessage } from '../model.js';
import type { Queryable } from './db.js';

/**
 * The channel on which a stopping worker hands the announcements it will not call to the other
 * workers. Its own Kafka partitions stay with it while it restarts (static membership), so without
 * this the runs it held wait for the others' polling fallback (`HELIOS_POLL_OVERDUE_MS` late).
 */
export const HANDOFF_CHANNEL = 'helios_handoff';

/** NOTIFY payloads must stay under 8000 bytes; a message is about 200. */
const MAX_PAYLOAD_BYTES = 7000;

/** One NOTIFY per payload, in one statement. $1 = payloads (JSON arrays of run messages). */
const NOTIFY = `SELECT pg_notify('${HANDOFF_CHANNEL}', payload) FROM unnest($1::text[]) AS payload`;

/**
 * Announces `messages` to every worker listening on {@link HANDOFF_CHANNEL}. Only a hint: each
 * receiver holds them like Kafka announcements, and the claim in PostgreSQL decides who runs one.
 * Returns the number of notifications sent.
 */
export async function handOffRuns(db: Queryable, messages: readonly RunMessage[]): Promise<number> {
  const payloads: string[] = [];
  let chunk: string[] = [];
  let bytes = 2;
  for (const message of messages) {
    const text = JSON.stringify(message);
    if (chunk.length > 0 && bytes + text.length + 1 > MAX_PAYLOAD_BYTES) {
      payloads.push(`[${chunk.join(',')}]`);
      chunk = [];
      bytes = 2;
    }
    chunk.push(text);
    bytes += text.length + 1;
  }
  if (chunk.length > 0) payloads.push(`[${chunk.join(',')}]`);
  if (payloads.length > 0) await db.query(NOTIFY, [payloads]);
  return payloads.length;
}
