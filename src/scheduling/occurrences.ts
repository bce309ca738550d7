import type { MisfirePolicy } from '../model.js';
import type { CronSchedule } from './cron.js';

/** What the dispatcher does with one due job in one pass. */
export interface OccurrencePlan {
  /** Occurrences to turn into runs, oldest first. */
  readonly fire: Date[];
  /** Late occurrences dropped by the misfire policy (capped count, for logs and metrics). */
  readonly dropped: number;
  /** Late occurrences the misfire policy fires anyway (the first entries of `fire`). */
  readonly lateFired: number;
  /** The first occurrence after the horizon; null when the schedule has none. */
  readonly nextRunAt: Date | null;
}

/** Most on-time occurrences one pass creates for one job (an every-second job in a long lookahead). */
const MAX_ON_TIME = 1000;

/**
 * Decides which occurrences of a job become runs now.
 * - Occurrences in [nextRunAt, now − misfireThreshold) are *late* (the cluster was down or
 *   leaderless): `skip` drops them, `fire-once` keeps the latest, `fire-all` keeps the latest
 *   `maxCatchUp` of them, oldest first.
 * - Occurrences in [now − misfireThreshold, horizon] are on time and always fire. The horizon is
 *   `now + lookahead`: runs are created ahead so workers can start them exactly when due.
 * The threshold keeps an ordinary failover (a few seconds without a leader) from counting as a
 * misfire, as Quartz's misfireThreshold does.
 */
export function planOccurrences(
  schedule: CronSchedule,
  job: { nextRunAt: Date; misfire: MisfirePolicy; maxCatchUp: number },
  now: Date,
  horizon: Date,
  misfireThresholdMs: number,
): OccurrencePlan {
  const cutoff = new Date(now.getTime() - misfireThresholdMs);
  const fire: Date[] = [];
  let dropped = 0;
  let lateFired = 0;
  if (job.nextRunAt < cutoff) {
    const keep = job.misfire === 'skip' ? 0 : job.misfire === 'fire-once' ? 1 : job.maxCatchUp;
    const late = latestBefore(schedule, job.nextRunAt, cutoff, Math.max(keep, 1) + 1);
    dropped = Math.max(0, late.total - keep);
    if (keep > 0) fire.push(...late.instants.slice(-keep));
    lateFired = fire.length;
  }
  const onTimeFrom = job.nextRunAt < cutoff ? cutoff : job.nextRunAt;
  const onTime = schedule.between(new Date(onTimeFrom.getTime() - 1), horizon, MAX_ON_TIME);
  fire.push(...onTime);
  // When the cap cut the on-time list short, the rest are picked up by the next pass.
  const after = onTime.length === MAX_ON_TIME ? onTime[MAX_ON_TIME - 1]! : horizon;
  return { fire, dropped, lateFired, nextRunAt: schedule.next(after) };
}

/**
 * The latest `want` occurrences in [from, before), and how many there are: exact when fewer than
 * `want` were found, else at least `want`. Walked back from `before` (CronSchedule.latest): a
 * window widened back from `before` until it held `want` collected every occurrence in its last
 * widening, up to a million, which for a dense schedule after a quiet stretch (every second on
 * weekdays, seen on a Sunday) was 0.7 s of cron maths for one job, even for `skip`.
 */
function latestBefore(schedule: CronSchedule, from: Date, before: Date, want: number) {
  const instants = schedule.latest(from, before, want);
  return { instants, total: instants.length };
}
