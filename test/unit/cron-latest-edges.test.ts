// CronSchedule.latest (the misfire catch-up's backward walk) at its edges, each case against the
// forward walk: boundaries, fractional milliseconds, year boundaries and the far past, DST.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { parseCron } from '../../src/scheduling/cron.js';

const iso = (d: Date[]) => d.map((x) => x.toISOString());
/** The oracle: every instant in [from, before) by the forward walk, its last `limit`. */
function forward(expr: string, tz: string, from: Date, before: Date, limit: number): Date[] {
  const s = parseCron(expr, tz);
  return s
    .between(new Date(from.getTime() - 1), new Date(before.getTime() - 1), 10_000_000)
    .slice(limit === 0 ? Infinity : -limit);
}
function check(
  expr: string,
  tz: string,
  from: string | number,
  before: string | number,
  limit: number,
  expect?: string[],
) {
  const f = new Date(from);
  const b = new Date(before);
  const actual = iso(parseCron(expr, tz).latest(f, b, limit));
  const oracle = iso(forward(expr, tz, f, b, limit));
  const label = `${expr} ${tz} [${f.toISOString()}, ${b.toISOString()}) limit ${limit}`;
  assert.deepEqual(actual, oracle, label);
  if (expect) assert.deepEqual(actual, expect, label);
}

test('from inclusive, before exclusive, fractional milliseconds', () => {
  const X = Date.parse('2026-05-05T10:00:00Z');
  check('* * * * * *', 'UTC', X, X + 3000, 10, [
    '2026-05-05T10:00:00.000Z',
    '2026-05-05T10:00:01.000Z',
    '2026-05-05T10:00:02.000Z',
  ]);
  check('* * * * * *', 'UTC', X + 1, X + 3001, 10, [
    '2026-05-05T10:00:01.000Z',
    '2026-05-05T10:00:02.000Z',
    '2026-05-05T10:00:03.000Z',
  ]);
  check('* * * * * *', 'UTC', X - 1, X + 2999, 10);
  check('* * * * * *', 'UTC', X + 999, X + 1000, 10, []);
  check('* * * * * *', 'UTC', X + 999, X + 1001, 10, ['2026-05-05T10:00:01.000Z']);
  check('* * * * * *', 'Europe/Berlin', X + 500, X + 5500, 2);
  check('0 * * * *', 'Asia/Kolkata', X, X + 86_400_000, 100);
  check('* * * * * *', 'UTC', X, X, 10, []);
  check('* * * * * *', 'UTC', X + 5000, X, 10, []);
  check('* * * * * *', 'UTC', X, X + 5000, 0, []);
});

test('year boundaries, leap days, sparse schedules, far past', () => {
  check('* * * * * *', 'UTC', '2025-12-31T23:59:50Z', '2026-01-01T00:00:10Z', 100);
  check('0 0 1 1 *', 'UTC', '2000-01-01T00:00:00Z', '2026-01-01T00:00:00Z', 5);
  check('0 0 1 1 *', 'UTC', '2000-01-01T00:00:00Z', '2026-01-01T00:00:00.001Z', 5);
  check('0 0 1 1 *', 'Pacific/Kiritimati', '2000-01-01T00:00:00Z', '2026-06-01T00:00:00Z', 5);
  check('59 23 31 12 *', 'Pacific/Pago_Pago', '1990-01-01T00:00:00Z', '2027-01-01T00:00:00Z', 40);
  check('0 0 29 2 *', 'UTC', '1880-01-01T00:00:00Z', '1910-01-01T00:00:00Z', 10); // 1900 is no leap year
  check('0 0 29 2 *', 'UTC', '2025-01-01T00:00:00Z', '2027-01-01T00:00:00Z', 10, []);
  check('0 0 29 2 *', 'America/New_York', '1700-01-01T00:00:00Z', '2101-01-01T00:00:00Z', 1000);
  check('0 12 * * 5#2', 'America/New_York', '1900-01-01T00:00:00Z', '1902-01-01T00:00:00Z', 1000);
  check('30 2 * * *', 'Europe/Berlin', '1890-01-01T00:00:00Z', '1895-01-01T00:00:00Z', 10); // LMT offset with seconds
  check('0 0 * * *', 'UTC', '0001-01-01T00:00:00Z', '0001-02-01T00:00:00Z', 100);
  check('0 0 * * *', 'UTC', '0001-01-01T00:00:00Z', '0001-01-03T00:00:00Z', 100);
});

test('never fires in [from, before): returns [] without walking forever', () => {
  const s = parseCron('0 0 29 2 *', 'UTC');
  assert.deepEqual(s.latest(new Date('2026-01-01T00:00:00Z'), new Date('2026-12-01T00:00:00Z'), 5), []);
  // from far before year 1: croner stops at year 1 and the walk stops with it
  const few = s.latest(new Date(-8.64e15), new Date('0010-01-01T00:00:00Z'), 100);
  assert.ok(few.length <= 3, iso(few).join());
});

test('before in or at a DST gap or overlap', () => {
  // Berlin 2026-03-29: 01:00Z the clock jumps 02:00 -> 03:00; 2026-10-25: 01:00Z 03:00 -> 02:00.
  const gap = Date.parse('2026-03-29T01:00:00Z');
  const back = Date.parse('2026-10-25T01:00:00Z');
  for (const expr of [
    '* * * * * *',
    '*/30 * * * *',
    '30 2 * * *',
    '0,30 2,3 * * *',
    '* 2 * * *',
    '59 1 * * *',
  ])
    for (const zone of ['Europe/Berlin', 'Australia/Lord_Howe'])
      for (const d of [-3_600_001, -1000, -1, 0, 1, 999, 1000, 1800_000, 3_600_000, 3_600_001])
        for (const limit of [1, 200]) {
          const span = expr.startsWith('* * ') ? 2 * 3_600_000 : 2 * 86_400_000;
          check(expr, zone, gap - span, gap + d, limit);
          check(expr, zone, back - span, back + d, limit);
          check(expr, zone, gap + d - 1000, gap + span, limit);
        }
});
