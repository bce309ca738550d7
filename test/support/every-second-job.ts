import type pg from 'pg';
import { uniqueId } from './env.js';
import { waitFor, type TargetServer } from './execution.js';
import { apiCall } from './node-api.js';
import { loggedAt, type LogLine, type ManagedProcess } from './processes.js';

// What the failover tests share: an every-second job whose occurrences are counted one by one, the
// node that leads, and the leaders' step-downs and the stall watch's verdicts as one timeline.

/** The API's answer for a job, as far as these tests read it. */
export interface JobAnswer {
  id: string;
  createdAt: string;
  updatedAt: string;
}

/**
 * Creates an every-second job through `apiUrl` that calls `target` (timeout 1 s). Its misfire
 * policy is `skip` unless `extra` says otherwise: an occurrence no leader created in time then
 * has no run at all, which occurrencesNotRun reports.
 */
export function createEverySecondJob(
  apiUrl: string,
  target: TargetServer,
  name: string,
  extra: Record<string, unknown> = {},
): Promise<JobAnswer> {
  return apiCall<JobAnswer>(apiUrl, 'POST', '/jobs', {
    name: `${name}-${uniqueId()}`,
    schedule: '* * * * * *',
    target: { url: `${target.url}/${name}`, method: 'POST' },
    timeoutMs: 1000,
    misfire: 'skip',
    ...extra,
  });
}

/** The index in `nodes` of the first to log "became leader". */
export function firstToLead(nodes: readonly { node: ManagedProcess }[], timeoutMs = 30_000): Promise<number> {
  return Promise.any(
    nodes.map(async ({ node }, i) => {
      await node.waitForLog((l) => l.msg === 'became leader', timeoutMs);
      return i;
    }),
  );
}

/** Pauses the job and waits until none of its runs is queued or running; the pause's answer. */
export async function pauseAndSettle(
  apiUrl: string,
  db: pg.Pool,
  jobId: string,
  timeoutMs = 60_000,
): Promise<JobAnswer> {
  const paused = await apiCall<JobAnswer>(apiUrl, 'POST', `/jobs/${jobId}/pause`);
  await waitFor(
    'every run of the job to end',
    async () => {
      const { rows } = await db.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM runs WHERE job_id = $1 AND state IN ('queued', 'running')`,
        [jobId],
      );
      return rows[0]!.n === 0;
    },
    timeoutMs,
  );
  return paused;
}

/**
 * Each scheduled occurrence of the job from its creation (or `from`, ms) to its pause that did not
 * run once, with what went wrong: no run, a run that did not succeed, or one never called at the
 * target. `label` names an occurrence (default: its ISO time).
 */
export async function occurrencesNotRun(
  db: pg.Pool,
  target: TargetServer,
  job: JobAnswer,
  paused: JobAnswer,
  options: { from?: number; label?: (at: number) => string } = {},
): Promise<string[]> {
  const { rows } = await db.query<{ state: string; at: Date }>(
    `SELECT state, scheduled_for AS at FROM runs WHERE job_id = $1 AND trigger = 'schedule'`,
    [job.id],
  );
  const runs = new Map(rows.map((r) => [r.at.getTime(), r]));
  const calls = new Set(target.forJob(job.id).map((c) => Date.parse(c.scheduledFor)));
  const from = options.from ?? Math.ceil((Date.parse(job.createdAt) + 150) / 1000) * 1000;
  const to = Date.parse(paused.updatedAt) - 150;
  const label = options.label ?? ((at: number) => new Date(at).toISOString());
  const problems: string[] = [];
  for (let at = Math.ceil(from / 1000) * 1000; at <= to; at += 1000) {
    const run = runs.get(at);
    if (!run) problems.push(`${label(at)}: no run`);
    else if (run.state !== 'succeeded') problems.push(`${label(at)}: ${run.state}`);
    else if (!calls.has(at)) problems.push(`${label(at)}: never called`);
  }
  return problems;
}

export { loggedAt };

/** A leader's step-down, election or stall-watch verdict, `t` ms after the moment asked about. */
export interface LeaderEvent {
  readonly node: string;
  readonly t: number;
  readonly line: LogLine;
}

/** The nodes' step-downs, elections and stall-watch lines since `since` (ms), in time order. */
export function leaderEvents(nodes: readonly { node: ManagedProcess }[], since: number): LeaderEvent[] {
  return nodes
    .flatMap(({ node }) =>
      node.logs
        .filter(
          (l) =>
            loggedAt(l) >= since &&
            (l.msg === 'stepped down' || l.msg === 'became leader' || l.part === 'stall-watch'),
        )
        .map((line) => ({ node: node.name, t: loggedAt(line) - since, line })),
    )
    .sort((a, b) => a.t - b.t);
}

/** One line for a test's output: each event as `+ms node what`. */
export function describeLeaderEvents(events: readonly LeaderEvent[]): string {
  const what = ({ line }: LeaderEvent) =>
    line.msg === 'stepped down'
      ? `stepped down (${String(line.reason)})`
      : line.msg === 'became leader'
        ? 'became leader'
        : /still leading/.test(String(line.msg))
          ? 'probe: at work'
          : /sessions is at work/.test(String(line.msg))
            ? 'probe: sessions lost'
            : 'probe: unreachable';
  return events.map((e) => `+${e.t} ${e.node} ${what(e)}`).join('; ') || 'no events';
}

/** The events that are step-downs for want of PostgreSQL, as `node +ms`. */
export function stepDownsAsCutOff(events: readonly LeaderEvent[]): string[] {
  return events
    .filter((e) => e.line.msg === 'stepped down' && e.line.reason === 'database-unreachable')
    .map((e) => `${e.node} +${e.t} ms`);
}
