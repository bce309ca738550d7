import { badRequest } from './problems.js';
import { isUuid } from './job-input.js';

/** A position in a keyset-paginated list: the sort timestamp (PostgreSQL text, µs kept) and id. */
export interface CursorPosition {
  readonly ts: string;
  readonly id: string;
}

/** Default page size when `limit` is not given. */
export const DEFAULT_LIMIT = 50;

const PG_TIMESTAMP = /^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(\.\d{1,6})?[+-]\d{2}(:\d{2})?$/;

/**
 * Cursors are opaque to clients (base64url of a JSON pair) so their contents may change. Keyset
 * pagination on (timestamp, id) is stable under concurrent inserts: a page never repeats or skips
 * a row that existed when the first page was read.
 */
export function encodeCursor(position: CursorPosition): string {
  return Buffer.from(JSON.stringify([position.ts, position.id])).toString('base64url');
}

/** @throws ProblemError (400, field `cursor`) for anything this API did not produce. */
export function decodeCursor(text: string | undefined): CursorPosition | null {
  if (text === undefined || text === '') return null;
  let pair: unknown;
  try {
    pair = JSON.parse(Buffer.from(text, 'base64url').toString('utf8'));
  } catch {
    pair = null;
  }
  if (
    Array.isArray(pair) &&
    pair.length === 2 &&
    typeof pair[0] === 'string' &&
    typeof pair[1] === 'string' &&
    PG_TIMESTAMP.test(pair[0]) &&
    isUuid(pair[1])
  ) {
    return { ts: pair[0], id: pair[1] };
  }
  throw badRequest([{ field: 'cursor', message: 'is not a cursor returned by this API' }]);
}

/**
 * Largest page body, as JSON: a page ends early (with a cursor) rather than grow past it. Jobs
 * may carry 64 KiB bodies each, so 500 of them would otherwise be a 32 MiB response held in
 * memory at once.
 */
export const MAX_PAGE_BYTES = 1024 * 1024;

/**
 * Cuts a list fetched with `limit + 1` rows into a page: the extra row only proves there is a
 * next page, whose cursor is the last row shown. A page also ends once its items reach
 * `maxBytes` as JSON (it always has at least one item), so its size is bounded by bytes too.
 */
export function toPage<R extends { cursorTs: string; id: string }, V>(
  rows: R[],
  limit: number,
  view: (row: R) => V,
  maxBytes = MAX_PAGE_BYTES,
): { items: V[]; nextCursor: string | null } {
  const items: V[] = [];
  let bytes = 0;
  for (const row of rows.slice(0, limit)) {
    const item = view(row);
    bytes += Buffer.byteLength(JSON.stringify(item) ?? '');
    if (items.length > 0 && bytes > maxBytes) break;
    items.push(item);
  }
  const last = rows[items.length - 1];
  return {
    items,
    nextCursor: rows.length > items.length && last ? encodeCursor({ ts: last.cursorTs, id: last.id }) : null,
  };
}
