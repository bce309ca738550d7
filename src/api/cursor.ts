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
 * Cuts a list fetched with `limit + 1` rows into a page: the extra row only proves there is a
 * next page, whose cursor is the last row shown.
 */
export function toPage<R extends { cursorTs: string; id: string }, V>(
  rows: R[],
  limit: number,
  view: (row: R) => V,
): { items: V[]; nextCursor: string | null } {
  const shown = rows.slice(0, limit);
  const last = shown.at(-1);
  return {
    items: shown.map(view),
    nextCursor: rows.length > limit && last ? encodeCursor({ ts: last.cursorTs, id: last.id }) : null,
  };
}
