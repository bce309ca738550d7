import { badRequest } from './problems.js';
import { isUuid } from './job-input.js';

/** A position in a keyset-paginated list: the sort timestamp (PostgreSQL text, µs kept) and id. */
export interface CursorPosition {
  readonly ts: string;
  readonly id: string;
}

/** Default page size when `limit` is not given. */
export const DEFAULT_LIMIT = 50;

const PG_TIMESTAMP =
  /^(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.\d{1,6})?[+-](\d{2})(?::(\d{2}))?$/;

/** PostgreSQL's widest UTC offset is 15:59 (MAX_TZDISP_HOUR); the pool's own is +00. */
const MAX_OFFSET_HOURS = 15;

/**
 * True when `ts` is PostgreSQL timestamptz text naming a real instant. The shape alone let
 * 2026-02-30 or 25:00 through to PostgreSQL, whose data exception was then a 400 naming no
 * query parameter.
 */
function isInstant(ts: string): boolean {
  const match = PG_TIMESTAMP.exec(ts);
  if (!match) return false;
  const [year, month, day, hour, minute, second, offsetHours, offsetMinutes] = match
    .slice(1)
    .map((part) => Number(part ?? 0)) as [number, number, number, number, number, number, number, number];
  // setUTCFullYear, not Date.UTC: Date.UTC reads years 0-99 as 1900-1999. Year 0 is no year to
  // PostgreSQL (1 BC is written with BC).
  const date = new Date(0);
  date.setUTCFullYear(year, month - 1, day);
  return (
    year >= 1 &&
    date.getUTCMonth() === month - 1 &&
    date.getUTCDate() === day &&
    hour < 24 &&
    minute < 60 &&
    second < 60 &&
    offsetHours <= MAX_OFFSET_HOURS &&
    offsetMinutes < 60
  );
}

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
    isInstant(pair[0]) &&
    isUuid(pair[1])
  ) {
    return { ts: pair[0], id: pair[1] };
  }
  throw badRequest([{ field: 'cursor', message: 'is not a cursor returned by this API' }]);
}

/**
 * Largest page body, as JSON: a page ends early (with a cursor) rather than grow past it. A job
 * carries its target, up to the request body limit (256 KiB by default), so 500 of them would
 * otherwise be a 125 MiB response held in memory at once.
 */
export const MAX_PAGE_BYTES = 1024 * 1024;

/** Reads up to `count` rows after a position (null: from the start), in the list's order. */
export type PageFetch<R> = (after: CursorPosition | null, count: number) => Promise<R[]>;

/**
 * Reads one page: at most `limit` items, ending early (with a cursor) once its items reach
 * `maxBytes` as JSON; it always has at least one item. A row past the page only proves there is a
 * next page, whose cursor is the page's last row.
 *
 * Rows are read `chunk` at a time (default: all `limit + 1` at once), and reading stops as soon as
 * the page is full. A list of large rows (a job carries its target, up to the request body limit)
 * reads in small chunks: 501 such rows read at once could be 125 MiB held in memory before the
 * byte bound cut the page to its first few.
 */
export async function readPage<R extends { cursorTs: string; id: string }, V>(
  fetch: PageFetch<R>,
  after: CursorPosition | null,
  limit: number,
  view: (row: R) => V,
  options: { readonly chunk?: number; readonly maxBytes?: number } = {},
): Promise<{ items: V[]; nextCursor: string | null }> {
  const { chunk = limit + 1, maxBytes = MAX_PAGE_BYTES } = options;
  const items: V[] = [];
  let bytes = 0;
  let last: R | undefined;
  for (;;) {
    const count = Math.min(chunk, limit + 1 - items.length);
    const rows = await fetch(last ? { ts: last.cursorTs, id: last.id } : after, count);
    for (const row of rows) {
      if (items.length === limit) return { items, nextCursor: cursorAfter(last!) };
      const item = view(row);
      bytes += Buffer.byteLength(JSON.stringify(item) ?? '');
      if (items.length > 0 && bytes > maxBytes) return { items, nextCursor: cursorAfter(last!) };
      items.push(item);
      last = row;
    }
    if (rows.length < count) return { items, nextCursor: null };
  }
}

function cursorAfter(row: { readonly cursorTs: string; readonly id: string }): string {
  return encodeCursor({ ts: row.cursorTs, id: row.id });
}
