import assert from 'node:assert/strict';
import { test } from 'node:test';
import { decodeCursor, readPage, type CursorPosition } from '../../src/api/cursor.js';

// A list of rows in order, read the way the store's list queries read: after a keyset position.
interface Row {
  readonly cursorTs: string;
  readonly id: string;
  readonly body: string;
}

const two = (n: number) => String(n).padStart(2, '0');

function rowsOf(sizes: number[]): Row[] {
  return sizes.map((size, i) => ({
    cursorTs: `2026-01-01 00:${two(Math.floor(i / 60))}:${two(i % 60)}+00`,
    id: `00000000-0000-4000-8000-${String(i).padStart(12, '0')}`,
    body: 'x'.repeat(size),
  }));
}

/** A fetch over `rows` that records how many rows each call asked for and got. */
function fetchOver(rows: Row[]) {
  const calls: { asked: number; got: number }[] = [];
  const fetch = async (after: CursorPosition | null, count: number) => {
    const start = after ? rows.findIndex((r) => r.id === after.id) + 1 : 0;
    const got = rows.slice(start, start + count);
    calls.push({ asked: count, got: got.length });
    return got;
  };
  return { fetch, calls, read: () => calls.reduce((n, c) => n + c.got, 0) };
}

const view = (row: Row) => ({ id: row.id, body: row.body });

test('a page of large rows read in chunks stops reading once its bytes are reached', async () => {
  // 500 rows of ~20 KiB: a page of 1 MiB holds 51 of them.
  const rows = rowsOf(Array.from({ length: 500 }, () => 20 * 1024));
  const source = fetchOver(rows);
  const page = await readPage(source.fetch, null, 500, view, { chunk: 32 });
  assert.equal(page.items.length, 51);
  assert.ok(
    source.calls.every((c) => c.asked <= 32),
    JSON.stringify(source.calls),
  );
  assert.ok(
    source.read() <= page.items.length + 32,
    `read ${source.read()} rows for a page of ${page.items.length}`,
  );
  assert.equal(decodeCursor(page.nextCursor!)?.id, rows[50]!.id);

  // The cursor leads on to every row, once each.
  const seen = page.items.map((i) => i.id);
  let cursor = page.nextCursor;
  while (cursor) {
    const next = await readPage(source.fetch, decodeCursor(cursor), 500, view, { chunk: 32 });
    seen.push(...next.items.map((i) => i.id));
    cursor = next.nextCursor;
  }
  assert.deepEqual(
    seen,
    rows.map((r) => r.id),
  );
});

test('a page ends at its limit, with a cursor only when a row lies past it', async () => {
  for (const [length, limit, chunk] of [
    [10, 10, 3],
    [11, 10, 3],
    [10, 10, undefined],
    [11, 10, undefined],
    [0, 5, 2],
    [7, 1, 1],
  ] as const) {
    const rows = rowsOf(Array.from({ length }, () => 10));
    const source = fetchOver(rows);
    const page = await readPage(source.fetch, null, limit, view, { chunk });
    const label = `${length} rows, limit ${limit}, chunk ${chunk}`;
    assert.deepEqual(
      page.items.map((i) => i.id),
      rows.slice(0, limit).map((r) => r.id),
      label,
    );
    assert.equal(page.nextCursor !== null, length > limit, label);
    assert.ok(source.read() <= limit + 1, label);
    if (chunk === undefined) assert.equal(source.calls.length, 1, `${label}: one statement`);
  }
});

test('a page always has its first row, however large, and the byte bound counts the views', async () => {
  const rows = rowsOf([3 * 1024 * 1024, 10, 10]);
  const page = await readPage(fetchOver(rows).fetch, null, 50, view, { chunk: 2 });
  assert.deepEqual(
    page.items.map((i) => i.id),
    [rows[0]!.id],
  );
  assert.equal(decodeCursor(page.nextCursor!)?.id, rows[0]!.id);

  const small = rowsOf([100, 100, 100, 100]);
  const cut = await readPage(fetchOver(small).fetch, null, 50, view, { maxBytes: 400 });
  assert.equal(cut.items.length, 2, 'two views of ~160 bytes fit in 400, three do not');
});

test('random lists, limits, chunks and byte bounds: the cursors reach every row once, in order, and no page is empty with a cursor', async () => {
  let seed = 12345;
  const rand = (n: number) => {
    seed = (seed * 1103515245 + 12345) & 0x7fffffff;
    return seed % n;
  };
  for (let round = 0; round < 3000; round++) {
    const rows = rowsOf(Array.from({ length: rand(40) }, () => (rand(3) === 0 ? rand(400) : rand(20))));
    const limit = 1 + rand(12);
    const chunk = rand(2) ? 1 + rand(6) : undefined;
    const maxBytes = 1 + rand(600);
    const source = fetchOver(rows);
    const seen: string[] = [];
    let cursor: CursorPosition | null = null;
    for (let pages = 0; ; pages++) {
      const label = JSON.stringify({ length: rows.length, limit, chunk, maxBytes, pages });
      assert.ok(pages <= rows.length + 1, `too many pages ${label}`);
      const page = await readPage(source.fetch, cursor, limit, view, { chunk, maxBytes });
      assert.ok(page.items.length <= limit, label);
      if (page.nextCursor !== null) assert.ok(page.items.length > 0, `empty page with a cursor ${label}`);
      if (page.items.length > 1) {
        const bytes = page.items.reduce((n, i) => n + Buffer.byteLength(JSON.stringify(i)), 0);
        assert.ok(bytes <= maxBytes, label);
      }
      seen.push(...page.items.map((i) => i.id));
      if (page.nextCursor === null) break;
      cursor = decodeCursor(page.nextCursor);
    }
    assert.deepEqual(
      seen,
      rows.map((r) => r.id),
    );
    assert.ok(source.calls.every((c) => c.asked >= 1 && c.asked <= (chunk ?? limit + 1)));
  }
});
