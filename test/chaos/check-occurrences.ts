/**
 * Occurrences against the reference model: every occurrence the model says must run executed
 * exactly once (or its absence is a misfire the job's policy allows), none that must not run
 * did, no occurrence was delivered by two different runs, and each went to the target in force.
 */
import { arrivalDeadline } from './check-runs.js';
import { expectations, whyNot, type JobHistory } from './model.js';
import {
  groupBy,
  iso,
  type Delivery,
  type Findings,
  type Observations,
  type RunRow,
} from './observations.js';

/** Boundary fuzz of "late" (created after the misfire threshold) vs "on time". */
const LATE_FUZZ_MS = 300;
/** Report at most this many lines per kind of violation (the count is always reported). */
const SHOWN = 5;

function report(violations: string[], label: string, items: string[]): void {
  if (items.length === 0) return;
  violations.push(`${items.length} ${label}:`);
  for (const item of items.slice(0, SHOWN)) violations.push(`    ${item}`);
  if (items.length > SHOWN) violations.push(`    … and ${items.length - SHOWN} more`);
}

/**
 * Instants at which the leader created runs: every pass creates some, because every-second
 * steady jobs always have a new occurrence entering the lookahead. A pass in
 * [at − lookahead, at + threshold) would have created an occurrence `at` on time, if it came
 * after the last edit that made (or withdrew and re-made) that occurrence (`since`).
 */
function dispatcherWasBack(passes: readonly number[], at: number, since: number, obs: Observations): boolean {
  const { lookaheadMs, misfireThresholdMs } = obs.settings;
  const from = Math.max(at - lookaheadMs, since) + LATE_FUZZ_MS;
  const to = at + misfireThresholdMs - LATE_FUZZ_MS;
  return passes.some((p) => p >= from && p <= to);
}

function isLate(run: RunRow, obs: Observations): boolean {
  return run.createdAt - run.scheduledFor > obs.settings.misfireThresholdMs + LATE_FUZZ_MS;
}

export function checkOccurrences(obs: Observations): Findings {
  const violations: string[] = [];
  const lines: string[] = [];
  const passes = [...new Set(obs.runs.filter((r) => r.createdEpoch !== null).map((r) => r.createdAt))].sort(
    (a, b) => a - b,
  );
  const runsByJob = groupBy(
    obs.runs.filter((r) => r.trigger === 'schedule'),
    (r) => r.jobId,
  );
  const deliveriesByJob = groupBy(obs.deliveries, (d) => d.jobId);
  const missing: string[] = [];
  const forbidden: string[] = [];
  const doubled: string[] = [];
  const wrongTarget: string[] = [];
  const misfires: string[] = [];
  const unexplainedGap: string[] = [];
  let must = 0;
  let either = 0;
  let mustNot = 0;
  let excused = 0;
  let deletedPending = 0;

  for (const job of obs.jobs) {
    const runs = new Map((runsByJob.get(job.id) ?? []).map((r) => [r.scheduledFor, r]));
    const deliveries = groupBy(deliveriesByJob.get(job.id) ?? [], (d) => d.scheduledFor);
    const executed = (at: number): Delivery[] => {
      const run = runs.get(at);
      const arrived = deliveries.get(at) ?? [];
      if (run?.state === 'skipped') return [];
      return arrived;
    };
    // `forbid` skips an occurrence that finds the job active, `replace` may fail a run before
    // its call started: accounted for (check-policies.ts judges whether that was allowed).
    const skippedByPolicy = (at: number) => {
      const reason = runs.get(at)?.reason;
      return reason === 'concurrency-forbid' || reason === 'replaced';
    };
    const label = (at: number) => `${job.name} (${job.role}, ${job.misfire}) at ${iso(at)}`;
    const excusedMisses: number[] = [];
    const deletedSentAt = obs.ops.find(
      (o) => o.kind === 'delete' && o.jobId === job.id && o.outcome === 'ok',
    )?.sentAt;
    for (const e of expectations(job, obs.windowStart, obs.windowEnd, obs.settings.opToleranceMs)) {
      const arrived = executed(e.at);
      const runIds = new Set(arrived.map((d) => d.runId));
      if (runIds.size > 1)
        doubled.push(`${label(e.at)}: delivered by ${runIds.size} different runs ${[...runIds].join(', ')}`);
      if (e.verdict === 'either') either += 1;
      if (e.verdict === 'must-not') {
        mustNot += 1;
        if (arrived.length > 0)
          forbidden.push(
            `${label(e.at)} ran ${whyNot(e.decidedBy ?? null, e.at)} (run ${arrived[0]!.runId})`,
          );
        continue;
      }
      if (e.targetPath !== undefined) {
        const wrong = arrived.find((d) => d.path !== e.targetPath);
        if (wrong)
          wrongTarget.push(`${label(e.at)} called ${wrong.path}, the target in force was ${e.targetPath}`);
      }
      if (e.verdict !== 'must') continue;
      must += 1;
      if (arrived.length > 0 || skippedByPolicy(e.at)) continue;
      if (!dispatcherWasBack(passes, e.at, e.since, obs)) {
        excused += 1;
        excusedMisses.push(e.at);
        const near = obs.faults.some(
          (f) =>
            e.at >= f.start - obs.settings.lookaheadMs &&
            e.at <= f.end + obs.settings.misfireThresholdMs + 3000,
        );
        if (!near)
          unexplainedGap.push(`${label(e.at)}: no leader created runs around it and no fault was near`);
        continue;
      }
      // Deleting a job deletes its pending runs (README): one still legitimately waiting (a fault
      // held it up) when the delete was sent is gone with the job.
      if (deletedSentAt !== undefined && arrivalDeadline(obs, e.at) >= deletedSentAt) {
        deletedPending += 1;
        continue;
      }
      const run = runs.get(e.at);
      const what = run
        ? `its run ${run.id} is ${run.state}${run.reason ? ` (${run.reason})` : ''}`
        : 'no run';
      missing.push(`${label(e.at)}: ${what}, though a leader was creating runs within the misfire threshold`);
    }
    misfires.push(...checkMisfirePolicy(job, [...runs.values()], excusedMisses, obs));
  }
  lines.push(
    `occurrences judged: must run ${must} (missing ${missing.length}, missed by misfire ${excused}, ` +
      `deleted with their job while still pending ${deletedPending}), ` +
      `must not run ${mustNot} (ran ${forbidden.length}), either ${either}; ` +
      `delivered by two runs ${doubled.length}; wrong target ${wrongTarget.length}`,
  );
  report(violations, 'occurrences that must have run did not', missing);
  report(violations, 'occurrences that must not have run did', forbidden);
  report(violations, 'occurrences delivered by more than one run', doubled);
  report(violations, 'occurrences called a target that was not in force', wrongTarget);
  report(violations, 'misfire policy violations', misfires);
  report(violations, 'occurrences missed with no fault to explain the leader’s absence', unexplainedGap);
  return { violations, lines };
}

/**
 * After the dispatcher was away longer than the threshold: `skip` creates no late run, `fire-once`
 * at most one per pass (and one after a gap it missed), `fire-all` at most maxCatchUp per pass.
 */
function checkMisfirePolicy(
  job: JobHistory,
  runs: RunRow[],
  excusedMisses: number[],
  obs: Observations,
): string[] {
  const problems: string[] = [];
  const late = runs.filter((r) => r.createdEpoch !== null && isLate(r, obs));
  const allowed = job.misfire === 'skip' ? 0 : job.misfire === 'fire-once' ? 1 : job.maxCatchUp;
  for (const [createdAt, group] of groupBy(late, (r) => r.createdAt)) {
    if (group.length > allowed)
      problems.push(
        `${job.name} (${job.misfire}${job.misfire === 'fire-all' ? ` ${job.maxCatchUp}` : ''}): one pass at ` +
          `${iso(createdAt)} created ${group.length} late runs (${group.map((r) => iso(r.scheduledFor)).join(', ')})`,
      );
  }
  if (allowed > 0 && excusedMisses.length > 0) {
    // The occurrences fired late after a gap are those right after the dropped ones.
    const last = Math.max(...excusedMisses);
    const after = runs
      .filter((r) => r.scheduledFor > last)
      .sort((a, b) => a.scheduledFor - b.scheduledFor)[0];
    if (after && !(after.createdAt - after.scheduledFor > obs.settings.misfireThresholdMs - LATE_FUZZ_MS))
      problems.push(
        `${job.name} (${job.misfire}): occurrences up to ${iso(last)} were dropped but none was fired late ` +
          `(next run ${iso(after.scheduledFor)} created on time)`,
      );
  }
  return problems;
}
