/**
 * The reference model of the chaos run: what each job looked like over time, built only from the
 * answers of the REST API (what each call returned and when it was sent and answered), and from
 * it which occurrences must run, which must not, and which may go either way.
 *
 * Time is wall-clock ms. An operation takes effect at one instant inside [sentAt, answeredAt]
 * (the database's now() of its transaction; database and chaos run share one host clock), so an
 * occurrence within `toleranceMs` of that interval may see the job before or after the change.
 */

export type JobRole = 'steady' | 'ops' | 'failing' | 'forbid' | 'replace';
export type Misfire = 'fire-once' | 'fire-all' | 'skip';

/** The job as one API answer left it, valid from some instant in [from0, from1]. */
export interface JobVersion {
  readonly from0: number;
  readonly from1: number;
  readonly exists: boolean;
  readonly enabled: boolean;
  /** A 6-field cron whose only non-`*` field is the seconds: `*` or `*\/n` (n divides 60). */
  readonly schedule: string;
  /** The path of the target URL (the target server tells versions apart by it). */
  readonly targetPath: string;
  /** What the job does with occurrences it missed: the version in force when one fell due judges it. */
  readonly misfire: Misfire;
  readonly maxCatchUp: number;
  /** What made this version, for messages: create, pause, resume, patch-schedule, … */
  readonly cause: string;
}

export interface JobHistory {
  readonly id: string;
  readonly name: string;
  readonly role: JobRole;
  /** In time order; the first is the creation. */
  readonly versions: JobVersion[];
  /** An operation whose outcome is unknown (no answer) was sent at this instant: not judged after it. */
  uncertainFrom?: number;
}

/** Period in seconds of one of the schedules the chaos jobs use. */
export function periodSeconds(schedule: string): number {
  const [seconds, ...rest] = schedule.trim().split(/\s+/);
  if (rest.length !== 5 || rest.some((f) => f !== '*')) throw new Error(`unsupported schedule ${schedule}`);
  if (seconds === '*') return 1;
  const match = /^\*\/(\d+)$/.exec(seconds ?? '');
  if (!match || 60 % Number(match[1]) !== 0) throw new Error(`unsupported schedule ${schedule}`);
  return Number(match[1]);
}

/** True when `at` (ms) is an occurrence of `schedule` (UTC; whole seconds only). */
export function isOccurrence(schedule: string, at: number): boolean {
  if (at % 1000 !== 0) return false;
  return new Date(at).getUTCSeconds() % periodSeconds(schedule) === 0;
}

/** The versions that may be in force at `at`: `null` stands for "before the job existed". */
export function possibleVersions(job: JobHistory, at: number, toleranceMs: number): (JobVersion | null)[] {
  const { versions } = job;
  const possible: (JobVersion | null)[] = [];
  if (versions.length === 0 || at <= versions[0]!.from1 + toleranceMs) possible.push(null);
  versions.forEach((version, i) => {
    const next = versions[i + 1];
    const couldHaveStarted = version.from0 - toleranceMs <= at;
    const couldStillHold = next === undefined || at <= next.from1 + toleranceMs;
    if (couldHaveStarted && couldStillHold) possible.push(version);
  });
  return possible;
}

/** A misfire policy: `maxCatchUp` counts for `fire-all` only. */
export type MisfirePolicy = Pick<JobVersion, 'misfire' | 'maxCatchUp'>;

/** Every policy, `fire-all` with any maxCatchUp: what an operation that got no answer may have set. */
const ANY_POLICY: readonly MisfirePolicy[] = [
  { misfire: 'fire-once', maxCatchUp: 1 },
  { misfire: 'skip', maxCatchUp: 1 },
  { misfire: 'fire-all', maxCatchUp: Infinity },
];

/**
 * The misfire policies that may judge the occurrence at `at`: those of the versions that may be in
 * force then (each once), so an occurrence due while an edit of the policy may have landed is judged
 * by either; from an operation whose outcome is unknown on, any (`uncertainFrom`: not judged). An
 * instant before the job existed has none; its first definition stands in (a run there comes from
 * the tolerance only).
 */
export function misfirePolicies(job: JobHistory, at: number, toleranceMs: number): MisfirePolicy[] {
  if (job.uncertainFrom !== undefined && at >= job.uncertainFrom - toleranceMs) return [...ANY_POLICY];
  const versions = possibleVersions(job, at, toleranceMs).filter((v) => v !== null);
  return distinctPolicies(versions.length > 0 ? versions : job.versions.slice(0, 1));
}

/** Each policy of `policies` once, in order. */
export function distinctPolicies(policies: readonly MisfirePolicy[]): MisfirePolicy[] {
  const distinct: MisfirePolicy[] = [];
  for (const { misfire, maxCatchUp } of policies)
    if (!distinct.some((p) => p.misfire === misfire && p.maxCatchUp === maxCatchUp))
      distinct.push({ misfire, maxCatchUp });
  return distinct;
}

/** How many late runs one dispatch pass may create for a job under `policy`. */
export function lateRunsAllowed(policy: MisfirePolicy): number {
  return policy.misfire === 'skip' ? 0 : policy.misfire === 'fire-once' ? 1 : policy.maxCatchUp;
}

/** Policies for messages: `fire-once`, `fire-all 2`, `skip or fire-all 2` (any maxCatchUp: `fire-all`). */
export function describePolicies(policies: readonly MisfirePolicy[]): string {
  const one = (p: MisfirePolicy) =>
    p.misfire === 'fire-all' && Number.isFinite(p.maxCatchUp) ? `fire-all ${p.maxCatchUp}` : p.misfire;
  return policies.map(one).join(' or ');
}

function shouldRun(version: JobVersion | null, at: number): boolean {
  return version !== null && version.exists && version.enabled && isOccurrence(version.schedule, at);
}

/** Why a version does not run an occurrence, for violation messages. */
export function whyNot(version: JobVersion | null, at: number): string {
  if (version === null) return 'before the job was created';
  if (!version.exists) return `after the job was deleted (${version.cause})`;
  if (!version.enabled) return `while the job was paused (${version.cause})`;
  if (!isOccurrence(version.schedule, at))
    return `not an occurrence of the schedule in force (${version.schedule})`;
  return 'no reason';
}

/** What the model says about one occurrence of one job. */
export interface Expectation {
  readonly at: number;
  /** 'must': clearly due while enabled; 'must-not': clearly not due; 'either': an operation was too close. */
  readonly verdict: 'must' | 'must-not' | 'either';
  /** The target path the run must call, when every version that runs it agrees. */
  readonly targetPath?: string;
  /** The version whose rule decided a 'must-not' (for the message). */
  readonly decidedBy?: JobVersion | null;
  /**
   * When the latest change that may govern this occurrence was answered: its run can only have
   * been created (or created again, after an edit withdrew it) by a dispatch pass after that.
   */
  readonly since: number;
}

/** Every whole second of [from, to] (ms) that some version of the job may run or must not run. */
export function expectations(job: JobHistory, from: number, to: number, toleranceMs: number): Expectation[] {
  const result: Expectation[] = [];
  const first = Math.ceil(from / 1000) * 1000;
  const schedules = [...new Set(job.versions.map((v) => v.schedule))];
  for (let at = first; at <= to; at += 1000) {
    if (job.uncertainFrom !== undefined && at >= job.uncertainFrom - toleranceMs) break;
    if (!schedules.some((s) => isOccurrence(s, at))) continue;
    const possible = possibleVersions(job, at, toleranceMs);
    const runs = possible.map((v) => shouldRun(v, at));
    const since = Math.max(...possible.map((v) => v?.from1 ?? -Infinity));
    if (runs.every(Boolean)) {
      const paths = new Set(possible.map((v) => v!.targetPath));
      result.push({ at, since, verdict: 'must', targetPath: paths.size === 1 ? [...paths][0] : undefined });
    } else if (runs.every((r) => !r)) {
      result.push({ at, since, verdict: 'must-not', decidedBy: possible[possible.length - 1] ?? null });
    } else {
      const paths = new Set(possible.filter((v) => shouldRun(v, at)).map((v) => v!.targetPath));
      result.push({ at, since, verdict: 'either', targetPath: paths.size === 1 ? [...paths][0] : undefined });
    }
  }
  return result;
}

/** The job after one more API answer: a copy of the latest version with `change` applied. */
export function addVersion(
  job: JobHistory,
  change: Partial<Omit<JobVersion, 'from0' | 'from1' | 'cause'>>,
  at: { from0: number; from1: number; cause: string },
): void {
  const last = job.versions.at(-1);
  if (!last) throw new Error(`job ${job.name} has no version to change`);
  job.versions.push({ ...last, ...change, ...at });
}
