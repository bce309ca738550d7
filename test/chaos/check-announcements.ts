/**
 * The outbox against the run topic, consumed from the beginning after the run: every outbox row
 * was published and reached Kafka; a row reached it more than once only when a fault could have
 * interrupted the relay between its publish and its mark (design item 4: a crash there
 * re-publishes); nothing reached the topic that no outbox row announced.
 */
import { groupBy, iso, type Fault, type Findings } from './observations.js';

export interface OutboxRow {
  readonly id: string;
  readonly runId: string;
  readonly attempt: number;
  readonly publishedAt: number | null;
}

export interface Announcement {
  readonly runId: string;
  readonly attempt: number;
}

/** How long before its mark a row may have been published (one relay batch with retries). */
const PUBLISH_WINDOW_MS = 10_000;

export function checkAnnouncements(
  outbox: readonly OutboxRow[],
  messages: readonly Announcement[],
  faults: readonly Fault[],
): Findings {
  const violations: string[] = [];
  const key = (a: { runId: string; attempt: number }) => `${a.runId}/${a.attempt}`;
  const rows = groupBy(outbox, key);
  const seen = groupBy(messages, key);
  const unpublished = outbox.filter((r) => r.publishedAt === null);
  let lost = 0;
  let duplicated = 0;
  let unexplained = 0;
  for (const [k, list] of rows) {
    const published = list.filter((r) => r.publishedAt !== null);
    const count = seen.get(k)?.length ?? 0;
    if (count < published.length) {
      lost += 1;
      if (lost <= 5)
        violations.push(`outbox row ${published[0]!.id} (${k}) was marked published but is not on the topic`);
    }
    if (count > list.length) {
      duplicated += 1;
      const at = Math.max(...published.map((r) => r.publishedAt!));
      const fault = faults.find((f) => f.start <= at && f.end >= at - PUBLISH_WINDOW_MS);
      if (!fault) {
        unexplained += 1;
        if (unexplained <= 5)
          violations.push(
            `${k} is on the topic ${count} times for ${list.length} outbox rows (marked ${iso(at)}), with no fault`,
          );
      }
    }
  }
  const phantoms = [...seen.keys()].filter((k) => !rows.has(k));
  for (const k of phantoms.slice(0, 5))
    violations.push(`${k} is on the topic but no outbox row announced it`);
  for (const r of unpublished.slice(0, 5))
    violations.push(`outbox row ${r.id} (${key(r)}) was never published`);
  return {
    violations,
    lines: [
      `announcements: outbox rows ${outbox.length} (unpublished ${unpublished.length}), messages on the topic ` +
        `${messages.length}; rows lost ${lost}, on the topic more than once ${duplicated} (unexplained ${unexplained}), ` +
        `messages with no row ${phantoms.length}`,
    ],
  };
}
