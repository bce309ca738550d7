import assert from 'node:assert/strict';
import { test } from 'node:test';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { Cron } from 'croner';

import { InvalidCronError, isValidTimezone, parseCron } from '../../src/scheduling/cron.js';

const iso = (dates: Date[]) => dates.map((d) => d.toISOString());
const at = (text: string) => new Date(text);

/** Fire instants in (from, to] as ISO strings. */
function fires(expression: string, timezone: string, from: string, to: string, limit = 1000): string[] {
  return iso(parseCron(expression, timezone).between(at(from), at(to), limit));
}

function assertRejected(field: 'schedule' | 'timezone', expression: string, timezone?: string): void {
  assert.throws(
    () => parseCron(expression, timezone),
    (err: unknown) => {
      assert.ok(err instanceof InvalidCronError, `expected InvalidCronError for "${expression}"`);
      assert.equal(err.field, field);
      assert.equal(err.name, 'InvalidCronError');
      assert.ok(err.message.includes(field === 'schedule' ? expression : String(timezone)), err.message);
      return true;
    },
  );
}

test('a 5-field expression fires at second 0 of the matching minutes', () => {
  const schedule = parseCron('30 2 * * *');
  assert.equal(schedule.timezone, 'UTC');
  assert.equal(schedule.expression, '30 2 * * *');
  assert.deepEqual(iso(schedule.nextN(at('2026-01-01T00:00:00Z'), 2)), [
    '2026-01-01T02:30:00.000Z',
    '2026-01-02T02:30:00.000Z',
  ]);
});

test('a 6-field expression reads seconds first', () => {
  assert.deepEqual(iso(parseCron('15 30 2 * * *').nextN(at('2026-01-01T02:30:15Z'), 2)), [
    '2026-01-02T02:30:15.000Z',
    '2026-01-03T02:30:15.000Z',
  ]);
  assert.deepEqual(iso(parseCron('*/20 0 0 1 1 *').nextN(at('2026-01-01T00:00:00Z'), 3)), [
    '2026-01-01T00:00:20.000Z',
    '2026-01-01T00:00:40.000Z',
    '2027-01-01T00:00:00.000Z',
  ]);
});

test('an every-second schedule gives consecutive whole seconds strictly after a fractional instant', () => {
  const schedule = parseCron('* * * * * *');
  assert.deepEqual(iso(schedule.nextN(at('2026-05-01T10:00:00.250Z'), 3)), [
    '2026-05-01T10:00:01.000Z',
    '2026-05-01T10:00:02.000Z',
    '2026-05-01T10:00:03.000Z',
  ]);
  assert.equal(schedule.next(at('2026-05-01T10:00:00.999Z'))?.toISOString(), '2026-05-01T10:00:01.000Z');
  assert.equal(schedule.next(at('2026-05-01T10:00:00.000Z'))?.toISOString(), '2026-05-01T10:00:01.000Z');
  assert.equal(
    parseCron('0 * * * *').next(at('2026-05-01T10:00:00Z'))?.toISOString(),
    '2026-05-01T11:00:00.000Z',
  );
});

test('wrong field counts are rejected as schedule errors', () => {
  for (const expression of ['', '   ', '* * * *', '* * * * * * *', '@daily', '0 0 1 1 * 2026']) {
    assertRejected('schedule', expression);
  }
});

test('garbage and out-of-range fields are rejected as schedule errors', () => {
  for (const expression of [
    'a b c d e',
    '61 * * * *',
    '* 24 * * *',
    '* * 0 * *',
    '* * * 13 *',
    '* * * * 8',
    '*/0 * * * *',
    '5-1 * * * *',
    '0 0 1W * *',
    '? * * * *',
    '0 0 1-? * *',
    '0 0 * * 1:2',
    '2026-01-01T00:00:00 * * * *',
    '0 0 30 2 *', // 30 February never happens
    '0 0 LW * *', // croner 11 reads W (nearest weekday); Helios does not
    '0 0 15w * *',
    '0 0 1 * +MON', // croner 11 reads '+' as "day fields AND"; Helios keeps OR
    '0 0 * * +1',
  ]) {
    assertRejected('schedule', expression);
  }
});

test('forms accepted before the croner 11 upgrade still parse, with the same meaning', () => {
  const from = at('2026-01-07T00:00:00Z');
  // A numeric step start (Quartz style) and a step without start, as croner 9 read them.
  assert.deepEqual(iso(parseCron('5/20 * * * *').nextN(from, 3)), [
    '2026-01-07T00:05:00.000Z',
    '2026-01-07T00:25:00.000Z',
    '2026-01-07T00:45:00.000Z',
  ]);
  assert.deepEqual(iso(parseCron('/30 * * * *').nextN(from, 2)), [
    '2026-01-07T00:30:00.000Z',
    '2026-01-07T01:00:00.000Z',
  ]);
  // The W check is for day-of-month only: WED in day-of-week is a name.
  assert.equal(parseCron('0 0 * * WED').next(from)?.toISOString(), '2026-01-14T00:00:00.000Z');
  assert.equal(parseCron('0 0 L * *').next(from)?.toISOString(), '2026-01-31T00:00:00.000Z');
  assert.equal(parseCron('0 0 * * 5#2').next(from)?.toISOString(), '2026-01-09T00:00:00.000Z');
});

test('a schedule that never fires is a schedule error, found by a bounded search', () => {
  const started = performance.now();
  for (const expression of [
    '0 0 31 2 *',
    '0 0 31 4 *',
    '0 0 30,31 2 *',
    '0 0 0 31 2 *',
    '* * * 31 2 *',
    // croner 9 overflowed its stack on these (a RangeError, so a 500 from the API).
    '0 0 31 4,6,9,11 *',
    '0 0 31 2,4,6,9,11 *',
    '59 59 23 31 4,6,9,11 *',
  ]) {
    assertRejected('schedule', expression);
    assert.throws(() => parseCron(expression, 'Europe/Berlin'), /it never fires/);
  }
  // The search walks about 400 years per expression: bounded, and cheap enough for an API call.
  assert.ok(performance.now() - started < 5000, 'the never-fires search is bounded');
  // Rare is not never: each of these fires, some only every few decades.
  const from = at('2026-12-01T00:00:00Z');
  assert.equal(parseCron('0 0 29 2 *').next(from)?.toISOString(), '2028-02-29T00:00:00.000Z');
  assert.equal(parseCron('0 0 31 2,3 *').next(from)?.toISOString(), '2027-03-31T00:00:00.000Z');
  // 31 February or any Monday in February (OR): the Mondays fire.
  assert.equal(parseCron('0 0 31 2 1').next(from)?.toISOString(), '2027-02-01T00:00:00.000Z');
  // A fifth Monday in February needs 29 February on a Monday; 2100 is not a leap year.
  assert.deepEqual(iso(parseCron('0 0 * 2 1#5').nextN(from, 3)), [
    '2044-02-29T00:00:00.000Z',
    '2072-02-29T00:00:00.000Z',
    '2112-02-29T00:00:00.000Z',
  ]);
});

test('unknown timezones are rejected as timezone errors', () => {
  for (const timezone of ['Mars/Olympus_Mons', 'Europe/Berlinn', '', '+01:00']) {
    assertRejected('timezone', '* * * * *', timezone);
  }
  assert.equal(isValidTimezone('Europe/Berlin'), true);
  assert.equal(isValidTimezone('Australia/Lord_Howe'), true);
  assert.equal(isValidTimezone('UTC'), true);
  assert.equal(isValidTimezone('Nowhere/Special'), false);
  assert.equal(isValidTimezone(''), false);
});

test('Europe/Berlin spring-forward: 02:30 fires once, at 03:00 CEST', () => {
  assert.deepEqual(fires('30 2 * * *', 'Europe/Berlin', '2026-03-27T00:00:00Z', '2026-03-31T00:00:00Z'), [
    '2026-03-27T01:30:00.000Z',
    '2026-03-28T01:30:00.000Z',
    '2026-03-29T01:00:00.000Z',
    '2026-03-30T00:30:00.000Z',
  ]);
});

test('Europe/Berlin spring-forward: every-15-minute times in the gap collapse into one fire', () => {
  assert.deepEqual(fires('*/15 * * * *', 'Europe/Berlin', '2026-03-29T00:30:00Z', '2026-03-29T01:30:00Z'), [
    '2026-03-29T00:45:00.000Z',
    '2026-03-29T01:00:00.000Z',
    '2026-03-29T01:15:00.000Z',
    '2026-03-29T01:30:00.000Z',
  ]);
  assert.deepEqual(iso(parseCron('* * * * * *', 'Europe/Berlin').nextN(at('2026-03-29T00:59:58Z'), 3)), [
    '2026-03-29T00:59:59.000Z',
    '2026-03-29T01:00:00.000Z',
    '2026-03-29T01:00:01.000Z',
  ]);
});

test('Europe/Berlin fall-back: 02:30 fires once, at its first (CEST) occurrence', () => {
  assert.deepEqual(fires('30 2 * * *', 'Europe/Berlin', '2026-10-23T00:00:00Z', '2026-10-27T00:00:00Z'), [
    '2026-10-23T00:30:00.000Z',
    '2026-10-24T00:30:00.000Z',
    '2026-10-25T00:30:00.000Z',
    '2026-10-26T01:30:00.000Z',
  ]);
  // Asked from inside the repeated hour, the second 02:30 is not offered.
  const next = parseCron('30 2 * * *', 'Europe/Berlin').next(at('2026-10-25T01:00:00Z'));
  assert.equal(next?.toISOString(), '2026-10-26T01:30:00.000Z');
});

test('Europe/Berlin fall-back: an every-15-minute job skips the repeated hour and resumes at 03:00 CET', () => {
  assert.deepEqual(fires('*/15 * * * *', 'Europe/Berlin', '2026-10-24T23:30:00Z', '2026-10-25T02:30:00Z'), [
    '2026-10-24T23:45:00.000Z',
    '2026-10-25T00:00:00.000Z',
    '2026-10-25T00:15:00.000Z',
    '2026-10-25T00:30:00.000Z',
    '2026-10-25T00:45:00.000Z',
    '2026-10-25T02:00:00.000Z',
    '2026-10-25T02:15:00.000Z',
    '2026-10-25T02:30:00.000Z',
  ]);
  const everySecond = parseCron('* * * * * *', 'Europe/Berlin');
  assert.equal(everySecond.next(at('2026-10-25T00:59:59Z'))?.toISOString(), '2026-10-25T02:00:00.000Z');
  assert.equal(everySecond.next(at('2026-10-25T01:30:00Z'))?.toISOString(), '2026-10-25T02:00:00.000Z');
});

test('Australia/Sydney: gap in October and overlap in April each fire once', () => {
  assert.deepEqual(fires('30 2 * * *', 'Australia/Sydney', '2026-10-02T00:00:00Z', '2026-10-05T00:00:00Z'), [
    '2026-10-02T16:30:00.000Z',
    '2026-10-03T16:00:00.000Z',
    '2026-10-04T15:30:00.000Z',
  ]);
  assert.deepEqual(fires('30 2 * * *', 'Australia/Sydney', '2026-04-03T00:00:00Z', '2026-04-06T00:00:00Z'), [
    '2026-04-03T15:30:00.000Z',
    '2026-04-04T15:30:00.000Z',
    '2026-04-05T16:30:00.000Z',
  ]);
});

test('Australia/Lord_Howe: the 30-minute gap and overlap each fire once', () => {
  assert.deepEqual(
    fires('*/15 * * * *', 'Australia/Lord_Howe', '2026-10-03T15:00:00Z', '2026-10-03T16:00:00Z'),
    [
      '2026-10-03T15:15:00.000Z',
      '2026-10-03T15:30:00.000Z',
      '2026-10-03T15:45:00.000Z',
      '2026-10-03T16:00:00.000Z',
    ],
  );
  assert.deepEqual(
    fires('*/15 * * * *', 'Australia/Lord_Howe', '2026-04-04T14:30:00Z', '2026-04-04T15:45:00Z'),
    ['2026-04-04T14:45:00.000Z', '2026-04-04T15:30:00.000Z', '2026-04-04T15:45:00.000Z'],
  );
  assert.deepEqual(
    fires('45 1 * * *', 'Australia/Lord_Howe', '2026-04-03T00:00:00Z', '2026-04-06T00:00:00Z'),
    ['2026-04-03T14:45:00.000Z', '2026-04-04T14:45:00.000Z', '2026-04-05T15:15:00.000Z'],
  );
});

test('a whole skipped day (Pacific/Apia, 30 Dec 2011) fires once at the end of the gap', () => {
  assert.deepEqual(fires('0 12 * * *', 'Pacific/Apia', '2011-12-29T00:00:00Z', '2011-12-31T00:00:00Z'), [
    '2011-12-29T22:00:00.000Z',
    '2011-12-30T10:00:00.000Z',
    '2011-12-30T22:00:00.000Z',
  ]);
});

test('fixed-offset zones shift wall times by their offset', () => {
  assert.equal(
    parseCron('0 9 * * *', 'Etc/GMT-5').next(at('2026-06-01T00:00:00Z'))?.toISOString(),
    '2026-06-01T04:00:00.000Z',
  );
  assert.equal(
    parseCron('0 9 * * *', 'Asia/Kathmandu').next(at('2026-06-01T00:00:00Z'))?.toISOString(),
    '2026-06-01T03:15:00.000Z',
  );
});

test('nextN returns n instants, oldest first', () => {
  // 2026-01-02 is a Friday: the next weekday runs are Monday to Wednesday.
  assert.deepEqual(iso(parseCron('0 9 * * 1-5').nextN(at('2026-01-02T10:00:00Z'), 3)), [
    '2026-01-05T09:00:00.000Z',
    '2026-01-06T09:00:00.000Z',
    '2026-01-07T09:00:00.000Z',
  ]);
  assert.deepEqual(parseCron('0 9 * * 1-5').nextN(at('2026-01-02T10:00:00Z'), 0), []);
  assert.throws(() => parseCron('* * * * *').nextN(at('2026-01-01T00:00:00Z'), -1), RangeError);
});

test('between excludes from, includes to and stops at limit', () => {
  const all = fires('*/10 * * * *', 'UTC', '2026-01-01T00:00:00Z', '2026-01-01T01:00:00Z');
  assert.deepEqual(all, [
    '2026-01-01T00:10:00.000Z',
    '2026-01-01T00:20:00.000Z',
    '2026-01-01T00:30:00.000Z',
    '2026-01-01T00:40:00.000Z',
    '2026-01-01T00:50:00.000Z',
    '2026-01-01T01:00:00.000Z',
  ]);
  assert.deepEqual(
    fires('*/10 * * * *', 'UTC', '2026-01-01T00:00:00Z', '2026-01-01T01:00:00Z', 3),
    all.slice(0, 3),
  );
  assert.deepEqual(fires('*/10 * * * *', 'UTC', '2026-01-01T00:00:00Z', '2026-01-01T00:09:59Z'), []);
});

test('day-of-month and day-of-week combine with OR when both are restricted (Vixie cron)', () => {
  const from = at('2026-01-01T00:00:00Z');
  // The 13th (a Tuesday in January 2026) or any Friday.
  assert.deepEqual(iso(parseCron('0 0 13 * 5').nextN(from, 4)), [
    '2026-01-02T00:00:00.000Z',
    '2026-01-09T00:00:00.000Z',
    '2026-01-13T00:00:00.000Z',
    '2026-01-16T00:00:00.000Z',
  ]);
  assert.deepEqual(iso(parseCron('0 0 * * FRI').nextN(from, 3)), [
    '2026-01-02T00:00:00.000Z',
    '2026-01-09T00:00:00.000Z',
    '2026-01-16T00:00:00.000Z',
  ]);
  assert.deepEqual(iso(parseCron('0 0 13 * *').nextN(from, 2)), [
    '2026-01-13T00:00:00.000Z',
    '2026-02-13T00:00:00.000Z',
  ]);
  // Quartz-style '?' means "any" in a day field, so this is Mondays only.
  assert.deepEqual(iso(parseCron('0 0 ? * MON').nextN(from, 2)), [
    '2026-01-05T00:00:00.000Z',
    '2026-01-12T00:00:00.000Z',
  ]);
});

/** Local wall time of `t` as fake-UTC ms, read by a formatter independent of the code under test. */
function wallClock(format: Intl.DateTimeFormat, t: number): number {
  const p = Object.fromEntries(format.formatToParts(t).map((part) => [part.type, Number(part.value)]));
  return Date.UTC(p.year ?? 0, (p.month ?? 1) - 1, p.day, p.hour, p.minute, p.second);
}

/**
 * Reference model: walk real time minute by minute; each matching wall time fires at the first
 * instant the local clock reaches or passes it, and never again once the clock has been there.
 */
function simulate(expression: string, timezone: string, from: number, to: number): string[] {
  const format = new Intl.DateTimeFormat('en-US', {
    timeZone: timezone,
    hourCycle: 'h23',
    year: 'numeric',
    month: 'numeric',
    day: 'numeric',
    hour: 'numeric',
    minute: 'numeric',
    second: 'numeric',
  });
  const matcher = new Cron(expression, { paused: true, utcOffset: 0 });
  const out: string[] = [];
  let reached = wallClock(format, from);
  for (let t = from + 60_000; t <= to; t += 60_000) {
    const wall = wallClock(format, t);
    if (wall <= reached) continue;
    const due = matcher.nextRun(new Date(reached));
    if (due !== null && due.getTime() <= wall) out.push(new Date(t).toISOString());
    reached = wall;
  }
  return out;
}

/** Instants (whole minutes) where `timezone`'s offset changes during 2026. */
function transitions2026(timezone: string): number[] {
  const format = new Intl.DateTimeFormat('en-US', { timeZone: timezone, timeZoneName: 'longOffset' });
  const offset = (t: number) => format.formatToParts(t).find((part) => part.type === 'timeZoneName')?.value;
  const found: number[] = [];
  for (let t = Date.UTC(2026, 0, 1); t < Date.UTC(2027, 0, 1); t += 3_600_000) {
    if (offset(t) === offset(t + 3_600_000)) continue;
    let minute = t;
    while (offset(minute) === offset(t)) minute += 60_000;
    found.push(minute);
  }
  return found;
}

test('every 2026 transition in several zones matches a minute-by-minute wall-clock simulation', () => {
  const zones = [
    'Europe/Berlin',
    'America/New_York',
    'America/Santiago',
    'Australia/Sydney',
    'Australia/Lord_Howe',
  ];
  const expressions = ['*/15 * * * *', '30 2 * * *', '0 0 * * *', '45 1 * * *', '10,40 0-3 * * *'];
  let checked = 0;
  for (const timezone of zones) {
    const found = transitions2026(timezone);
    assert.ok(found.length >= 2, `${timezone} should have DST transitions in 2026`);
    for (const transition of found) {
      const from = transition - 5 * 3_600_000;
      const to = transition + 5 * 3_600_000;
      for (const expression of expressions) {
        const expected = simulate(expression, timezone, from, to);
        const actual = iso(parseCron(expression, timezone).between(new Date(from), new Date(to), 1000));
        assert.deepEqual(
          actual,
          expected,
          `${expression} in ${timezone} around ${new Date(transition).toISOString()}`,
        );
        checked += expected.length;
      }
    }
  }
  assert.ok(checked > 100);
});

test('day-of-month steps fire on 1 March in every zone, in leap and common years (croner 9 skipped it)', () => {
  // Berlin is on winter time and Sydney on summer time from 15 February to 10 March: no zone here
  // changes its offset inside the window.
  const zones = {
    UTC: 'Z',
    'Europe/Berlin': '+01:00',
    'Asia/Kolkata': '+05:30',
    'Australia/Sydney': '+11:00',
  };
  const cases = [
    // */10 is days 1, 11, 21, 31; */6 is 1, 7, 13, 19, 25, 31; */7 is 1, 8, 15, 22, 29.
    { expression: '0 0 */10 * *', days: ['02-21', '03-01', '03-11'] },
    { expression: '0 0 0 */6 * *', days: ['02-19', '02-25', '03-01', '03-07'] },
    { expression: '0 0 */7 * *', days: ['02-22', '03-01', '03-08'], leapDays: ['02-22', '02-29', '03-01'] },
  ];
  for (const year of [2026, 2028, 2100]) {
    const leap = year % 4 === 0 && year % 100 !== 0;
    for (const [timezone, offset] of Object.entries(zones)) {
      for (const { expression, days, leapDays } of cases) {
        const expected = (leap && leapDays ? leapDays : days).map((day) =>
          new Date(`${year}-${day}T00:00:00${offset}`).toISOString(),
        );
        const from = new Date(`${year}-02-15T12:00:00${offset}`);
        const actual = iso(parseCron(expression, timezone).nextN(from, expected.length));
        assert.deepEqual(actual, expected, `${expression} in ${timezone} from ${from.toISOString()}`);
      }
    }
  }
});

test('a parsed schedule keeps no year table of its own: 300 of them hold well under 300 × 78 KB', () => {
  // croner fills a 10,000-entry year table for every pattern (≈78 KB), although without a year
  // field it is all ones and never read; the leader caches up to 256 parsed schedules.
  setFlagsFromString('--expose-gc');
  const gc = runInNewContext('gc') as () => void;
  gc();
  const before = process.memoryUsage().heapUsed;
  const kept = Array.from({ length: 300 }, (_, n) => parseCron(`${n % 60} ${Math.floor(n / 60)} * * * *`));
  gc();
  const grownMb = (process.memoryUsage().heapUsed - before) / 1024 / 1024;
  assert.equal(kept.length, 300);
  assert.ok(grownMb < 5, `300 parsed schedules hold ${grownMb.toFixed(1)} MB`);
  // The shared table still answers as croner's own did.
  assert.deepEqual(iso(kept[61]!.nextN(new Date('2026-01-01T00:00:00Z'), 2)), [
    '2026-01-01T00:01:01.000Z',
    '2026-01-01T01:01:01.000Z',
  ]);
});
