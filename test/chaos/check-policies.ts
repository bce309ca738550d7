/**
 * Operations and concurrency policies: a trigger makes exactly one manual run that executes; a
 * replay runs the dead run again, to success once the target is healed; `forbid` skips an
 * occurrence only while another run of the job is active, never a retry or a replay, and never
 * has two calls open at once; `replace` fails a run as replaced only when one asked for later
 * (an occurrence at its scheduled time, a replayed run at its last replay) started.
 */
import { explainingFault } from './check-runs.js';
import { FAULTS_EXPLAINING_REDELIVERY } from './faults.js';
import {
  faultNodes,
  groupBy,
  iso,
  type Delivery,
  type Findings,
  type Observations,
  type RunRow,
  report,
} from './observations.js';

/** Slack for comparing instants written by different processes (claim, skip, HTTP arrival). */
const SLACK_MS = 300;

/** Faults during which a worker may be unable to write what its call did. */
const WRITE_HOLDING_FAULTS = new Set<string>(FAULTS_EXPLAINING_REDELIVERY);

/**
 * The latest instant a run's outcome was recorded. `finished_at` is when its call ended; the
 * outcome is written a round trip later, and `forbid` counts the run active until then. Only a
 * fault that keeps its worker from writing (on its node or PostgreSQL's: the kinds that explain a
 * redelivery) can hold the write longer: until the fault is over and the worker's write retry has
 * come round (settleMs).
 */
function recordedBy(obs: Observations, run: RunRow, finishedAt: number): number {
  const claimant = obs.attempts.find((a) => a.runId === run.id && a.attempt === run.attempt)?.nodeId;
  let latest = finishedAt;
  for (const f of obs.faults) {
    if (!WRITE_HOLDING_FAULTS.has(f.kind)) continue;
    if (f.start > finishedAt + SLACK_MS || f.end < finishedAt - SLACK_MS) continue;
    const nodes = faultNodes(f);
    if (nodes.length > 0 && (claimant === undefined || !nodes.includes(claimant))) continue;
    latest = Math.max(latest, f.end + obs.settings.settleMs);
  }
  return latest;
}

export function checkPolicies(obs: Observations): Findings {
  const violations: string[] = [];
  const runById = new Map(obs.runs.map((r) => [r.id, r]));
  const byRun = groupBy(
    [...obs.deliveries].sort((a, b) => a.arrivedAt - b.arrivedAt),
    (d) => d.runId,
  );
  const jobById = new Map(obs.jobs.map((j) => [j.id, j]));
  const deletedLater = (jobId: string | undefined, at: number) =>
    jobById.get(jobId ?? '')?.versions.some((v) => !v.exists && v.from1 >= at) ?? false;
  const tol = obs.settings.opToleranceMs;

  // Triggers: exactly one manual run per answered trigger, and it executes.
  const triggers: string[] = [];
  const triggerOps = obs.ops.filter((o) => o.kind === 'trigger');
  const claimedManual = new Set<string>();
  for (const op of triggerOps.filter((o) => o.outcome === 'ok')) {
    const run = runById.get(op.runId ?? '');
    if (!run) {
      if (!deletedLater(op.jobId, op.sentAt))
        triggers.push(`trigger at ${iso(op.sentAt)} answered run ${op.runId}, which does not exist`);
      continue;
    }
    claimedManual.add(run.id);
    if (run.trigger !== 'manual')
      triggers.push(`trigger answered run ${run.id}, which is a ${run.trigger} run`);
    if (run.scheduledFor < op.sentAt - tol || run.scheduledFor > op.answeredAt + tol)
      triggers.push(
        `manual run ${run.id} is scheduled for ${iso(run.scheduledFor)}, outside its trigger call`,
      );
    if (run.state !== 'succeeded' || !byRun.has(run.id))
      triggers.push(`manual run ${run.id} ended ${run.state} with ${byRun.get(run.id)?.length ?? 0} calls`);
  }
  const unknownTriggers = groupBy(
    triggerOps.filter((o) => o.outcome === 'unknown'),
    (o) => o.jobId,
  );
  for (const [jobId, manual] of groupBy(
    obs.runs.filter((r) => r.trigger === 'manual' && !claimedManual.has(r.id)),
    (r) => r.jobId,
  )) {
    const allowed = unknownTriggers.get(jobId)?.length ?? 0;
    if (manual.length > allowed)
      triggers.push(
        `${manual.length - allowed} manual runs of ${jobById.get(jobId)?.name ?? jobId} match no trigger call`,
      );
  }
  report(violations, 'trigger violations', triggers);

  // Replays: the dead run is called again with a newer attempt and succeeds.
  const replays: string[] = [];
  for (const op of obs.ops.filter((o) => o.kind === 'replay' && o.outcome === 'ok')) {
    const run = runById.get(op.runId ?? '');
    const again = (byRun.get(op.runId ?? '') ?? []).filter((d) => d.attempt > (op.deadAttempt ?? 0));
    if (!run) replays.push(`replayed run ${op.runId} does not exist`);
    else if (again.length === 0 || run.state !== 'succeeded')
      replays.push(
        `replayed run ${run.id} (dead at attempt ${op.deadAttempt}) was called ${again.length} times after the replay and ended ${run.state}`,
      );
  }
  report(violations, 'replay violations', replays);

  // forbid.
  // Each run's replays (dead letters replayed), for forbid and for replace's order below.
  const replaysOf = new Map<string, number[]>();
  for (const d of obs.deadLetters)
    if (d.replayedAt !== null) replaysOf.set(d.runId, [...(replaysOf.get(d.runId) ?? []), d.replayedAt]);
  const replayed = new Set(replaysOf.keys());
  const forbid: string[] = [];
  for (const [jobId, runs] of groupBy(
    obs.runs.filter((r) => r.concurrency === 'forbid'),
    (r) => r.jobId,
  )) {
    const name = jobById.get(jobId)?.name ?? jobId;
    // Misfires skipped at a claim are judged in check-occurrences.ts (checkMisfireSkips).
    for (const run of runs.filter(
      (r) => r.state === 'skipped' && r.reason !== 'paused' && r.reason !== 'misfire',
    )) {
      if (run.attempt > 0)
        forbid.push(`${name}: run ${run.id} was skipped after ${run.attempt} attempts: a retry was dropped`);
      if (replayed.has(run.id)) forbid.push(`${name}: run ${run.id} was replayed and then skipped`);
      // The skip was decided at a claim attempt between its due time and the skip's write.
      const at = run.finishedAt ?? run.scheduledFor;
      const sibling = runs.find(
        (o) =>
          o.id !== run.id &&
          // a sibling skipped after attempts (itself a violation) was active until its skip
          (o.state !== 'skipped' || o.attempt > 0) &&
          o.startedAt !== null &&
          o.startedAt <= at + SLACK_MS &&
          (o.finishedAt === null || recordedBy(obs, o, o.finishedAt) >= run.scheduledFor - SLACK_MS),
      );
      if (!sibling)
        forbid.push(
          `${name}: run ${run.id} due ${iso(run.scheduledFor)} was skipped at ${iso(at)} with no other run active`,
        );
    }
    forbid.push(...overlappingCalls(name, runs, byRun, obs));
  }
  report(violations, 'forbid violations', forbid);

  // replace: runs are ordered by when they were asked for, a replayed run by its last replay
  // before the instant in question (a replay after a replacement did not order it).
  const replace: string[] = [];
  const askedAt = (r: RunRow, by = Infinity) =>
    Math.max(r.scheduledFor, ...(replaysOf.get(r.id) ?? []).filter((t) => t <= by));
  // When r began: its first START (runs.started_at; a replay keeps it), its attempts (claimed, or
  // their calls' starts once written) and its calls' arrivals.
  const attemptStarts = groupBy(obs.attempts, (a) => a.runId);
  const starts = (r: RunRow) => [
    ...(r.startedAt === null ? [] : [r.startedAt]),
    ...(attemptStarts.get(r.id) ?? []).map((a) => a.startedAt),
    ...(byRun.get(r.id) ?? []).map((d) => d.arrivedAt),
  ];
  for (const [jobId, runs] of groupBy(
    obs.runs.filter((r) => r.concurrency === 'replace'),
    (r) => r.jobId,
  )) {
    const name = jobById.get(jobId)?.name ?? jobId;
    for (const run of runs.filter((r) => r.reason === 'replaced')) {
      const end = run.finishedAt ?? Infinity;
      // A run asked for after this one (as of its replacement) that began since it was asked for.
      const newer = runs.find((o) => {
        const asked = askedAt(o, end);
        return (
          asked > askedAt(run, end) && starts(o).some((t) => t >= asked - SLACK_MS && t <= end + SLACK_MS)
        );
      });
      if (!newer) replace.push(`${name}: run ${run.id} was replaced with no newer run started`);
    }
    const sorted = [...runs].sort((a, b) => askedAt(a) - askedAt(b));
    for (let i = 0; i + 1 < sorted.length; i++) {
      const older = sorted[i]!;
      const newer = sorted[i + 1]!;
      // The newer run's first call since it was asked for, and the older's last call begun before it.
      const next = byRun.get(newer.id)?.find((d) => d.arrivedAt >= askedAt(newer) - SLACK_MS);
      const call = next && byRun.get(older.id)?.findLast((d) => d.arrivedAt <= next.arrivedAt);
      if (!call || !next || call.endedAt === undefined) continue;
      // The older call was still open well after the newer one began: the older must be replaced.
      if (
        call.endedAt > next.arrivedAt + SLACK_MS &&
        older.reason !== 'replaced' &&
        !faultOnCall(obs, call, next)
      )
        replace.push(
          `${name}: run ${older.id} was still calling when ${newer.id} started, and ended ${older.state} (${older.reason ?? 'no reason'})`,
        );
    }
  }
  report(violations, 'replace violations', replace);
  return {
    violations,
    lines: [
      `operations: triggers ${triggerOps.length}, replays ${obs.ops.filter((o) => o.kind === 'replay').length}; ` +
        `forbid skips ${obs.runs.filter((r) => r.concurrency === 'forbid' && r.state === 'skipped').length}, ` +
        `replace replacements ${obs.runs.filter((r) => r.reason === 'replaced').length}`,
    ],
  };
}

function faultOnCall(obs: Observations, call: Delivery, next: Delivery): boolean {
  const claimant = obs.attempts.find((a) => a.runId === call.runId && a.attempt === call.attempt)?.nodeId;
  return explainingFault(obs.faults, claimant, call, next, 0) !== undefined;
}

/** Two calls of one `forbid` job open at once at the target (beyond the slack). */
function overlappingCalls(
  name: string,
  runs: RunRow[],
  byRun: Map<string, Delivery[]>,
  obs: Observations,
): string[] {
  const calls = runs.flatMap((r) => byRun.get(r.id) ?? []).sort((a, b) => a.arrivedAt - b.arrivedAt);
  const problems: string[] = [];
  for (let i = 0; i + 1 < calls.length; i++) {
    const a = calls[i]!;
    const b = calls[i + 1]!;
    if (a.runId === b.runId || a.endedAt === undefined) continue;
    if (a.endedAt > b.arrivedAt + SLACK_MS && !faultOnCall(obs, a, b))
      problems.push(
        `${name}: runs ${a.runId} and ${b.runId} were calling the target at the same time (${iso(b.arrivedAt)})`,
      );
  }
  return problems;
}
