import { Cron } from 'croner';

/**
 * A parsed cron schedule bound to an IANA timezone. Every instant it returns is a whole second.
 *
 * DST rules: a wall-clock time inside a gap fires once, at the first instant after the gap; a
 * wall-clock time inside an overlap fires once, at its first (earlier) occurrence.
 */
export interface CronSchedule {
  /** The expression exactly as given to {@link parseCron}. */
  readonly expression: string;
  /** The IANA timezone exactly as given to {@link parseCron} (default `UTC`). */
  readonly timezone: string;
  /** The next fire instant strictly after `after`; null only if the schedule never fires again. */
  next(after: Date): Date | null;
  /** Up to `n` fire instants strictly after `after`, oldest first. */
  nextN(after: Date, n: number): Date[];
  /** Every fire instant in `(from, to]`, oldest first, at most `limit` of them. */
  between(from: Date, to: Date, limit: number): Date[];
  /**
   * The latest `limit` fire instants in `[from, before)`, oldest first (all of them if fewer): a
   * misfire catch-up. Walks back from `before`, so it costs what it returns, however many
   * instants lie between `from` and the latest ones (a dense schedule after a quiet stretch).
   */
  latest(from: Date, before: Date, limit: number): Date[];
}

/** A cron expression or timezone was rejected; `field` names the job field to report (RFC 9457). */
export class InvalidCronError extends Error {
  override name = 'InvalidCronError';
  constructor(
    readonly field: 'schedule' | 'timezone',
    message: string,
  ) {
    super(message);
  }
}

/** True if `tz` is an IANA timezone this runtime knows (names are matched case-insensitively). */
export function isValidTimezone(tz: string): boolean {
  return zoneFor(tz) !== null;
}

/**
 * Parses a 5-field (`minute hour day-of-month month day-of-week`) or 6-field (seconds first) cron
 * expression. Day-of-month and day-of-week combine with OR when both are restricted (Vixie cron);
 * a day field is restricted unless it is exactly `*` or `?`, so a step over `*` is restricted
 * (Vixie cron would not). L and `#` are read as croner reads them; W and `+` are refused.
 * @param timezone IANA zone the expression's wall-clock times are read in; default `UTC`.
 * @throws InvalidCronError naming `schedule` (also for a schedule that never fires) or `timezone`.
 */
export function parseCron(expression: string, timezone = 'UTC'): CronSchedule {
  const cron = compile(expression);
  const zone = zoneFor(timezone);
  if (zone === null) throw new InvalidCronError('timezone', `unknown IANA timezone "${String(timezone)}"`);
  return new ZonedSchedule(expression, timezone, cron, zone);
}

const SECOND_MS = 1000;
const DAY_MS = 86_400_000;

/** Validates with our stricter rules first, then lets croner parse; croner always works in UTC. */
function compile(expression: string): Cron {
  const bad = (why: string) =>
    new InvalidCronError('schedule', `invalid cron expression "${expression}": ${why}`);
  if (typeof expression !== 'string') throw bad('not a string');
  const trimmed = expression.trim();
  const fields = trimmed === '' ? [] : trimmed.split(/\s+/);
  if (fields.length !== 5 && fields.length !== 6) {
    throw bad(
      `expected 5 fields (minute hour day-of-month month day-of-week) or 6 with seconds first, got ${fields.length}`,
    );
  }
  // croner treats any string with ':' as a one-off ISO date instead of a pattern.
  if (trimmed.includes(':')) throw bad("':' is not allowed");
  // croner 11 reads two extensions croner 9 rejected: '+' (day fields combined with AND) and 'W'
  // (nearest weekday, day-of-month only; in day-of-week a W can only be part of WED). Both stay
  // rejected so that the upgrade changed no schedule's meaning and the day fields stay OR.
  if (trimmed.includes('+')) throw bad("'+' is not allowed");
  const dom = fields.length - 3;
  const dow = fields.length - 1;
  if (/w/i.test(fields[dom] ?? '')) throw bad("'W' (nearest weekday) is not supported");
  const normalised = fields.map((field, i) => {
    // Quartz writes '?' for "any" in a day field. croner 9 substituted the time of parsing
    // (different on every node) and croner 11 reads '*' anywhere; Helios keeps accepting it only
    // where it always meant '*'.
    if (field === '?' && (i === dom || i === dow)) return '*';
    if (field.includes('?')) throw bad("'?' is only allowed as a whole day-of-month or day-of-week field");
    return field;
  });
  let cron: Cron;
  let first: Date | null;
  try {
    cron = new Cron(normalised.join(' '), {
      paused: true,
      mode: '5-or-6-parts',
      // Vixie cron: when both day fields are restricted, a day matching either one fires.
      domAndDow: false,
      // '5/5' and '/10' (read as 5-59/5 and */10) were accepted before croner made them opt-in;
      // stored jobs may use them, and a stored schedule that stops parsing gets its job parked.
      sloppyRanges: true,
      // utcOffset 0 keeps croner on pure UTC arithmetic: its `timezone` option costs ~50x more
      // and has DST rules of its own (interval jobs fire twice in an overlap); ours are below.
      utcOffset: 0,
    });
    first = cron.nextRun(NEVER_FIRES_FROM);
  } catch (err) {
    // A throw from the search counts too: croner 9 overflowed its stack on `0 0 31 4,6,9,11 *`.
    throw bad(err instanceof Error ? err.message.replace(/^CronPattern: /, '') : String(err));
  }
  // A job that can never run (31 April, 30 February) is a mistake worth a 400, not a silent null.
  // Without a year field a schedule repeats with the 400-year Gregorian cycle, so one occurrence
  // within 400 years of any instant means it fires forever. croner's walk (a loop in croner 11;
  // croner 9 recursed) gives up after about 400 years with null, in a few ms; the horizon keeps
  // the rule ours should croner ever search further.
  if (first === null || first.getTime() - NEVER_FIRES_FROM.getTime() > GREGORIAN_CYCLE_MS) {
    throw bad('it never fires');
  }
  shareYearTable(cron);
  return cron;
}

/**
 * croner gives every pattern its own 10,000-entry year table (≈78 KB), all ones when the pattern
 * has no year field, which ours never has (5 or 6 fields). A leader keeps up to
 * MAX_CACHED_SCHEDULES parsed schedules, so their tables were up to 20 MB of its heap (≈4.7 MB
 * with the memory benchmark's 60 schedules). croner only reads the table after parsing (and not
 * at all for a year of `*`): one shared table answers the same. Left alone should a croner
 * upgrade move or change it.
 */
function shareYearTable(cron: Cron): void {
  const pattern = (cron as unknown as { _states?: { pattern?: { starYear?: unknown; year?: unknown } } })
    ._states?.pattern;
  if (pattern?.starYear === true && Array.isArray(pattern.year) && pattern.year.length === ALL_YEARS.length) {
    pattern.year = ALL_YEARS;
  }
}

/** croner's year table for a pattern without a year field (years 0–9999 all match). */
const ALL_YEARS: readonly number[] = Array<number>(10_000).fill(1);

/** Where the "does it ever fire" search starts; any instant would do (see GREGORIAN_CYCLE_MS). */
const NEVER_FIRES_FROM = new Date(Date.UTC(2000, 0, 1));
/** 400 Gregorian years (146,097 days): dates and weekdays repeat exactly after it. */
const GREGORIAN_CYCLE_MS = 146_097 * DAY_MS;

class ZonedSchedule implements CronSchedule {
  constructor(
    readonly expression: string,
    readonly timezone: string,
    private readonly cron: Cron,
    private readonly zone: Zone,
  ) {}

  next(after: Date): Date | null {
    const at = this.nextInstant(toWholeSecond(after, 'after'));
    return at === null ? null : new Date(at);
  }

  nextN(after: Date, n: number): Date[] {
    checkCount(n, 'n');
    return this.collect(toWholeSecond(after, 'after'), Infinity, n);
  }

  between(from: Date, to: Date, limit: number): Date[] {
    checkCount(limit, 'limit');
    if (Number.isNaN(to.getTime())) throw new RangeError('to is an invalid Date');
    return this.collect(toWholeSecond(from, 'from'), to.getTime(), limit);
  }

  latest(from: Date, before: Date, limit: number): Date[] {
    checkCount(limit, 'limit');
    const lo = from.getTime();
    const hi = before.getTime();
    if (Number.isNaN(lo)) throw new RangeError('from is an invalid Date');
    if (Number.isNaN(hi)) throw new RangeError('before is an invalid Date');
    const zone = this.zone;
    // Fire instants are wallToInstant(wall) over the cron's wall times, which never decreases
    // with the wall time (a gap's wall times share one instant; an overlap's take its first
    // reading): walking the wall times back walks the instants back, equal ones next to each
    // other. A wall time past `hi` + the largest offset around `hi` fires at or after `hi`.
    const toInstant = (wall: number) =>
      zone.fixedOffset !== null ? wall - zone.fixedOffset : zone.wallToInstant(wall);
    const largestOffset =
      zone.fixedOffset ?? Math.max(zone.offsetAt(hi - DAY_MS), zone.offsetAt(hi), zone.offsetAt(hi + DAY_MS));
    let reference = hi + largestOffset + SECOND_MS;
    const out: number[] = [];
    let done = limit === 0;
    while (!done) {
      // previousRuns: wall times strictly before `reference` (whole seconds), latest first.
      const walls = this.cron.previousRuns(Math.min(1000, limit - out.length + 16), new Date(reference));
      if (walls.length === 0) break;
      for (const wall of walls) {
        const at = toInstant(wall.getTime());
        if (at >= hi || at === out[out.length - 1]) continue;
        if (at < lo || out.push(at) === limit) {
          done = true;
          break;
        }
      }
      reference = walls[walls.length - 1]!.getTime();
    }
    return out.reverse().map((at) => new Date(at));
  }

  private collect(from: number, to: number, limit: number): Date[] {
    const out: Date[] = [];
    let cursor = from;
    while (out.length < limit) {
      const at = this.nextInstant(cursor);
      if (at === null || at > to) break;
      out.push(new Date(at));
      cursor = at;
    }
    return out;
  }

  /** Next fire instant (ms) strictly after `from` (a whole second). */
  private nextInstant(from: number): number | null {
    const zone = this.zone;
    if (zone.fixedOffset !== null) {
      const wall = this.nextWall(from + zone.fixedOffset);
      return wall === null ? null : wall - zone.fixedOffset;
    }
    // Wall times are local clock readings stored as fake-UTC milliseconds.
    let wall = from + zone.offsetAt(from);
    for (;;) {
      const next = this.nextWall(wall);
      if (next === null) return null;
      const at = zone.wallToInstant(next);
      if (at > from) return at;
      // `from` is in the repeated part of an overlap and `next` already fired at its first
      // occurrence; skip to the end of the overlap instead of stepping through it one by one.
      const end = zone.transitionAfter(at);
      wall = end === null ? next : Math.max(next, end + zone.offsetAt(at) - SECOND_MS);
    }
  }

  private nextWall(wall: number): number | null {
    return this.cron.nextRun(new Date(wall))?.getTime() ?? null;
  }
}

/** The whole second at or before `date`, so "strictly after" never yields a fractional instant. */
function toWholeSecond(date: Date, name: string): number {
  const ms = date.getTime();
  if (Number.isNaN(ms)) throw new RangeError(`${name} is an invalid Date`);
  return Math.floor(ms / SECOND_MS) * SECOND_MS;
}

function checkCount(value: number, name: string): void {
  if (!Number.isSafeInteger(value) || value < 0)
    throw new RangeError(`${name} must be a non-negative integer`);
}

/** Offsets of one UTC day: `before` until the instant `at`, `after` from then on (`at` = Infinity if none). */
interface DayOffsets {
  readonly before: number;
  readonly after: number;
  readonly at: number;
}

/**
 * Offset lookups (ms, local = utc + offset) for one IANA zone. Intl costs microseconds per call,
 * so offsets are learned one UTC day at a time and cached; the dispatcher then pays a Map lookup.
 * Assumes at most one offset change per UTC day and per 48 hours around a wall time, which holds
 * for every zone's current rules.
 */
class Zone {
  /** Set for zones that never change offset (UTC, Etc/GMT±N): they skip all conversion. */
  readonly fixedOffset: number | null;
  private readonly days = new Map<number, DayOffsets>();

  constructor(private readonly format: Intl.DateTimeFormat) {
    const fixed = /^(?:Etc\/)?(?:UTC|GMT)(?:[+-]\d{1,2})?$/.test(format.resolvedOptions().timeZone);
    this.fixedOffset = fixed ? this.intlOffset(0) : null;
  }

  offsetAt(t: number): number {
    const day = this.day(Math.floor(t / DAY_MS));
    return t < day.at ? day.before : day.after;
  }

  /** The first instant after `t` at which the offset changes, looking into the next UTC day at most. */
  transitionAfter(t: number): number | null {
    const first = Math.floor(t / DAY_MS);
    for (let d = first; d <= first + 1; d++) {
      const { at } = this.day(d);
      if (at > t && at !== Infinity) return at;
    }
    return null;
  }

  /** The instant a wall time fires: in a gap the end of the gap, in an overlap the earlier reading. */
  wallToInstant(wall: number): number {
    // A real instant is within 14 hours of its wall time, so these bracket any transition.
    const before = this.offsetAt(wall - DAY_MS);
    const after = this.offsetAt(wall + DAY_MS);
    if (before === after) return wall - before;
    const early = wall - before;
    const late = wall - after;
    const earlyValid = this.offsetAt(early) === before;
    const lateValid = this.offsetAt(late) === after;
    if (earlyValid && lateValid) return Math.min(early, late);
    if (earlyValid) return early;
    if (lateValid) return late;
    // Gap: the clock jumped over `wall` at an instant between the two readings.
    return this.transitionAfter(Math.min(early, late)) ?? Math.max(early, late);
  }

  private day(index: number): DayOffsets {
    let day = this.days.get(index);
    if (day === undefined) {
      if (this.days.size >= MAX_CACHED_DAYS) this.days.clear();
      day = this.learnDay(index * DAY_MS);
      this.days.set(index, day);
    }
    return day;
  }

  private learnDay(start: number): DayOffsets {
    const before = this.intlOffset(start);
    const after = this.intlOffset(start + DAY_MS);
    if (before === after) return { before, after, at: Infinity };
    // Bounded binary search (17 steps) for the first whole second with the new offset.
    let lo = start;
    let hi = start + DAY_MS;
    while (hi - lo > SECOND_MS) {
      const mid = lo + Math.floor((hi - lo) / 2 / SECOND_MS) * SECOND_MS;
      if (this.intlOffset(mid) === before) lo = mid;
      else hi = mid;
    }
    return { before, after, at: hi };
  }

  private intlOffset(t: number): number {
    // en-US longOffset renders "GMT" for zero and "GMT+05:30" (rarely with seconds) otherwise.
    const text = this.format.format(t);
    const match = /GMT(?:([+\-\u2212])(\d{2}):(\d{2})(?::(\d{2}))?)?$/.exec(text);
    if (match === null) throw new Error(`cannot read a UTC offset from "${text}"`);
    const [, sign, h = '0', m = '0', s = '0'] = match;
    const ms = ((Number(h) * 60 + Number(m)) * 60 + Number(s)) * SECOND_MS;
    return sign === undefined || sign === '+' ? ms : -ms;
  }
}

const MAX_CACHED_DAYS = 4096;
const MAX_CACHED_ZONES = 1024;
const zones = new Map<string, Zone>();

/** The cached Zone for a name, or null if unknown; invalid names are not cached (they come from users). */
/**
 * IANA zone names (`Europe/Berlin`, `UTC`, `Etc/GMT+1`). Node.js 24's ICU also accepts UTC
 * offsets such as `+01:00` as a time zone; a fixed offset has no DST and is not a zone of the
 * IANA database, so we keep refusing it.
 */
const ZONE_NAME = /^[A-Za-z][A-Za-z0-9_+-]*(\/[A-Za-z0-9_+-]+)*$/;

function zoneFor(tz: string): Zone | null {
  if (typeof tz !== 'string' || !ZONE_NAME.test(tz)) return null;
  let zone = zones.get(tz);
  if (zone === undefined) {
    let format: Intl.DateTimeFormat;
    try {
      format = new Intl.DateTimeFormat('en-US', { timeZone: tz, timeZoneName: 'longOffset' });
    } catch {
      return null;
    }
    // Bounded because case variants of one name are distinct keys.
    if (zones.size >= MAX_CACHED_ZONES) zones.clear();
    zone = new Zone(format);
    zones.set(tz, zone);
  }
  return zone;
}
