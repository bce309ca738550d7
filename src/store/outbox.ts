import type { Queryable } from './db.js';

export interface OutboxRow {
  readonly id: string;
  readonly topic: string;
  readonly key: string;
  readonly payload: unknown;
}

/** Unpublished rows that are due, oldest first. $1 = limit. */
const SELECT_DUE = `
  SELECT id, topic, key, payload FROM outbox
  WHERE published_at IS NULL AND publish_after <= now()
  ORDER BY publish_after, id
  LIMIT $1`;

export async function selectDueOutbox(db: Queryable, limit: number): Promise<OutboxRow[]> {
  const { rows } = await db.query<OutboxRow>(SELECT_DUE, [limit]);
  return rows;
}

/** Marks rows published. $1 = ids. */
const MARK_PUBLISHED = `UPDATE outbox SET published_at = now() WHERE id = ANY($1::bigint[]) AND published_at IS NULL`;

export async function markPublished(db: Queryable, ids: string[]): Promise<void> {
  await db.query(MARK_PUBLISHED, [ids]);
}

/**
 * Records a failed publish on rows (they stay pending). $1 = ids, $2 = error text, $3 = whether to
 * put them off: a row the broker refused on its own is retried after a back-off that starts at 1 s
 * and doubles per try, up to a minute, so it cannot block the rows behind it; rows of an outage are not put off, so they go out as soon as the broker is back.
 */
const MARK_FAILED = `
  UPDATE outbox SET publish_tries = publish_tries + 1, last_error = left($2, 1000),
                    publish_after = CASE WHEN $3 THEN now() + least(60000, 1000 * 2 ^ least(publish_tries, 10))
                                                           * interval '1 millisecond'
                                         ELSE publish_after END
  WHERE id = ANY($1::bigint[])`;

export async function markPublishFailed(
  db: Queryable,
  ids: string[],
  error: string,
  putOff = false,
): Promise<void> {
  await db.query(MARK_FAILED, [ids, error, putOff]);
}

/** Milliseconds until the next pending row is due; null when none is pending. */
const NEXT_DUE = `
  SELECT (extract(epoch FROM min(publish_after) - now()) * 1000)::float8 AS "inMs"
  FROM outbox WHERE published_at IS NULL`;

export async function msUntilNextOutboxRow(db: Queryable): Promise<number | null> {
  const { rows } = await db.query<{ inMs: number | null }>(NEXT_DUE);
  return rows[0]?.inMs ?? null;
}
