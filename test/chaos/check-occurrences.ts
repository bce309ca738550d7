/**
 * Occurrences against the reference model: every occurrence the model says must run executed
 * exactly once (or its absence is a misfire the job's policy allows), none that must not run
 * did, no occurrence was delivered by two different runs, and each went to the target in force.
 */
import { leaderEpochs } from './check-leaders.js';
import { arrivalDeadline } from './check-runs.js';
import {
  describePolicies,
  distinctPolicies,
  expectations,
  lateRunsAllowed,
  misfirePolicies,
  whyNot,
  type JobHistory,
  type JobVersion,
} from './model.js';
import {
  faultNodes,
  groupBy,
  iso,
  type Delivery,
  type Findings,
  type Observations,
  type RunRow,
  withRunsReadBeforeDeletes,
  report,
} from './observations.js';

/** Log timestamps of two processes, and a leader's log line against its first write. */
const LOG_SLACK_MS = 250;
/** Boundary fuzz of "late" (created after the misfire threshold) vs "on time". */
const LATE_FUZZ_MS = 300;
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

/**
 * The deliveries that are calls of a scheduled occurrence. A manual run's X-Helios-Scheduled-For is
 * its trigger's now() cut to milliseconds: once in a thousand triggers it falls on a whole second and
 * looked like the occurrence of that second (run while paused, or delivered by two runs). A delivery
 * counts when its run is a schedule run; a run with no row (its job was deleted, its runs with it)
 * counts unless a trigger call answered with its id. Returns them and the manual deliveries left out.
 */
function occurrenceDeliveries(obs: Observations): { deliveries: Delivery[]; manual: Delivery[] } {
  const trigger = new Map(obs.runs.map((r) => [r.id, r.trigger]));
  for (const op of obs.ops)
    if (op.kind === 'trigger' && op.runId !== undefined && !trigger.has(op.runId))
      trigger.set(op.runId, 'manual');
  const deliveries: Delivery[] = [];
  const manual: Delivery[] = [];
  for (const d of obs.deliveries) (trigger.get(d.runId) === 'manual' ? manual : deliveries).push(d);
  return { deliveries, manual };
}

/** ms → the time of day (UTC) with milliseconds, for the dense details of a violation. */
const hms = (ms: number | null | undefined) =>
  ms === null || ms === undefined ? '-' : iso(ms).slice(11, 23);

/**
 * Everything the database and the target know of a run that delivered an occurrence, so that a
 * violation can be diagnosed from the CI output alone: trigger, state, attempts, who created it and
 * when, when it was marked started, which node made each attempt, and when each call arrived.
 */
function describeRun(runId: string, arrived: readonly Delivery[], obs: Observations): string {
  const run = obs.runs.find((r) => r.id === runId);
  const calls = arrived
    .filter((d) => d.runId === runId)
    .sort((a, b) => a.arrivedAt - b.arrivedAt)
    .map(
      (d) =>
        `#${d.attempt} at ${hms(d.arrivedAt)}` +
        ` (${d.aborted ? 'aborted' : (d.status ?? 'no answer')}${d.path ? ` ${d.path}` : ''})`,
    );
  const attempts = obs.attempts
    .filter((a) => a.runId === runId)
    .sort((a, b) => a.attempt - b.attempt)
    .map((a) => `#${a.attempt} ${a.nodeId} from ${hms(a.startedAt)} (${a.outcome ?? 'open'})`);
  const facts = run
    ? [
        `trigger ${run.trigger}`,
        `${run.state}${run.reason ? ` (${run.reason})` : ''}`,
        `attempt ${run.attempt}/${run.maxAttempts}`,
        `created ${hms(run.createdAt)} ${run.createdEpoch === null ? 'through the API (no epoch)' : `by epoch ${run.createdEpoch}`}`,
        `scheduled_for ${iso(run.scheduledFor)}`,
        `started_at ${hms(run.startedAt)}`,
        `finished_at ${hms(run.finishedAt)}`,
      ]
    : ['no row (its job was deleted?)'];
  return (
    `run ${runId}: ${facts.join(', ')}; attempts ${attempts.join(', ') || 'none recorded'}; ` +
    `calls ${calls.join(', ') || 'none'}`
  );
}

/**
 * The job's changes around a disabled version: the one that disabled it (a pause, a PATCH of
 * enabled, or an edit of a paused job that kept it paused) and the next one, with their calls'
 * sent and answered times, plus the job's trigger calls near `at`.
 */
function describeJobAround(
  job: JobHistory,
  decidedBy: JobVersion | null,
  at: number,
  obs: Observations,
): string {
  const parts: string[] = [];
  const call = (v: JobVersion) => `${v.cause} (sent ${hms(v.from0)}, in force by ${hms(v.from1)})`;
  const i = decidedBy ? job.versions.indexOf(decidedBy) : -1;
  if (i >= 0 && decidedBy!.exists && !decidedBy!.enabled) {
    let first = i;
    while (first > 0 && job.versions[first - 1]!.exists && !job.versions[first - 1]!.enabled) first -= 1;
    parts.push(`disabled by ${call(job.versions[first]!)}`);
    if (first !== i) parts.push(`then ${call(decidedBy!)}`);
  } else if (decidedBy) {
    parts.push(`in force: ${call(decidedBy)}`);
  }
  const next = i >= 0 ? job.versions[i + 1] : undefined;
  parts.push(next ? `next change ${call(next)}` : 'no later change');
  const triggers = obs.ops.filter(
    (o) => o.kind === 'trigger' && o.jobId === job.id && Math.abs(o.sentAt - at) <= 5000,
  );
  for (const t of triggers)
    parts.push(
      `trigger sent ${hms(t.sentAt)} answered ${hms(t.answeredAt)} ${t.outcome} run ${t.runId ?? '?'}`,
    );
  return parts.join('; ');
}

export function checkOccurrences(observed: Observations): Findings {
  // With the runs of jobs deleted later, as read before each delete: why their occurrences made no
  // call. Only their misfire skips excuse a missing occurrence, as checkMisfireSkips judges them
  // below; check-policies.ts, which judges `forbid` and `replace`, sees the database's runs only.
  const obs: Observations = {
    ...observed,
    runs: withRunsReadBeforeDeletes(observed.runs, observed.runsOfDeletedJobs ?? []),
  };
  const inDatabase = new Set(observed.runs.map((r) => r.id));
  const violations: string[] = [];
  const lines: string[] = [];
  const passes = [...new Set(obs.runs.filter((r) => r.createdEpoch !== null).map((r) => r.createdAt))].sort(
    (a, b) => a - b,
  );
  const runsByJob = groupBy(
    obs.runs.filter((r) => r.trigger === 'schedule'),
    (r) => r.jobId,
  );
  const { deliveries: scheduled, manual } = occurrenceDeliveries(obs);
  const deliveriesByJob = groupBy(scheduled, (d) => d.jobId);
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
    // its call started (check-policies.ts judges whether that was allowed), and a worker skips a
    // misfire its job's policy drops (checkMisfireSkips, below).
    const skippedByPolicy = (at: number) => {
      const run = runs.get(at);
      if (run?.reason === 'misfire') return true;
      if (run && !inDatabase.has(run.id)) return false;
      return run?.reason === 'concurrency-forbid' || run?.reason === 'replaced';
    };
    const label = (at: number) =>
      `${job.name} (${job.role}, ${describePolicies(misfirePolicies(job, at, obs.settings.opToleranceMs))}) at ${iso(at)}`;
    const excusedMisses: number[] = [];
    const deletedSentAt = obs.ops.find(
      (o) => o.kind === 'delete' && o.jobId === job.id && o.outcome === 'ok',
    )?.sentAt;
    for (const e of expectations(job, obs.windowStart, obs.windowEnd, obs.settings.opToleranceMs)) {
      const arrived = executed(e.at);
      const runIds = new Set(arrived.map((d) => d.runId));
      if (runIds.size > 1)
        doubled.push(
          `${label(e.at)}: delivered by ${runIds.size} different runs ${[...runIds].join(', ')}` +
            [...runIds].map((id) => `\n          ${describeRun(id, arrived, obs)}`).join(''),
        );
      if (e.verdict === 'either') either += 1;
      if (e.verdict === 'must-not') {
        mustNot += 1;
        if (arrived.length > 0)
          forbidden.push(
            `${label(e.at)} ran ${whyNot(e.decidedBy ?? null, e.at)} (run ${arrived[0]!.runId})` +
              [...runIds].map((id) => `\n          ${describeRun(id, arrived, obs)}`).join('') +
              `\n          job: ${describeJobAround(job, e.decidedBy ?? null, e.at, obs)}`,
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
      // A run still pending when its job was deleted went with it: say how late that was.
      const deleted =
        deletedSentAt === undefined
          ? ''
          : `; the job was deleted at ${iso(deletedSentAt)}, after the arrival deadline ${iso(arrivalDeadline(obs, e.at))}`;
      missing.push(
        `${label(e.at)}: ${what}, though a leader was creating runs within the misfire threshold${deleted}`,
      );
    }
    misfires.push(...checkMisfirePolicy(job, [...runs.values()], excusedMisses, obs));
  }
  lines.push(
    `occurrences judged: must run ${must} (missing ${missing.length}, missed by misfire ${excused}, ` +
      `deleted with their job while still pending ${deletedPending}), ` +
      `must not run ${mustNot} (ran ${forbidden.length}), either ${either}; ` +
      `delivered by two runs ${doubled.length}; wrong target ${wrongTarget.length}; ` +
      `calls of manual runs left out ${manual.length} (on a whole second ${manual.filter((d) => d.scheduledFor % 1000 === 0).length}); ` +
      `misfires skipped at a claim ${obs.runs.filter((r) => r.reason === 'misfire').length}`,
  );
  report(violations, 'occurrences that must have run did not', missing);
  report(violations, 'occurrences that must not have run did', forbidden);
  report(violations, 'occurrences delivered by more than one run', doubled);
  report(violations, 'occurrences called a target that was not in force', wrongTarget);
  report(violations, 'misfire policy violations', misfires);
  report(violations, 'misfire skips at a claim not allowed', checkMisfireSkips(obs, runsByJob));
  report(violations, 'occurrences missed with no fault to explain the leader’s absence', unexplainedGap);
  return { violations, lines };
}

/**
 * Runs a worker skipped at its claim as misfires (reason `misfire`, store/runs.ts misfiredAtClaim):
 * each must be a scheduled occurrence a leader created, never claimed, whose leader's epoch ended
 * before the skip (a newer one began, or its leader stepped down, died or froze: etcd's leader key
 * is gone then, which the workers read), skipped more than the threshold after it was due (or made,
 * for a catch-up's run), of a `skip` job, or of a `fire-once` job with a later occurrence late
 * too (a run due more than the threshold before the skip, or one the dispatcher or a command
 * created late: the latest missed, which fires, unless `skip` then), and near a fault: without one
 * no worker should have come that late. The policy is the one in force when the run fell due (a
 * worker judges the run's copy, which an edit of the policy changes for the occurrences after it);
 * within an edit's tolerance either policy may judge it.
 */
export function checkMisfireSkips(obs: Observations, runsByJob: Map<string, RunRow[]>): string[] {
  const problems: string[] = [];
  const threshold = obs.settings.misfireThresholdMs;
  const jobs = new Map(obs.jobs.map((j) => [j.id, j]));
  const epochs = leaderEpochs(obs.processes);
  const tolerance = obs.settings.opToleranceMs;
  for (const run of obs.runs) {
    const job = jobs.get(run.jobId);
    if (run.state !== 'skipped' || run.reason !== 'misfire' || !job) continue;
    const at = run.finishedAt ?? run.scheduledFor;
    const inForce = misfirePolicies(job, run.scheduledFor, tolerance);
    const policies = inForce.map((p) => p.misfire);
    const label = `${job.name} (${describePolicies(inForce)}): run ${run.id} due ${iso(run.scheduledFor)} skipped at ${iso(at)}`;
    if (policies.every((p) => p === 'fire-all'))
      problems.push(`${label}, though fire-all fires every missed occurrence`);
    if (run.trigger !== 'schedule' || run.attempt > 0)
      problems.push(`${label}, a ${run.trigger} run after ${run.attempt} attempts: it was owed`);

    // Its epoch had ended: a newer one had begun (it wrote the fence), or, as etcd tells the
    // workers, its leader key was gone: it stepped down, or it died or froze and its lease could
    // have expired by then (its last keep-alive at most a third of the TTL before the halt).
    const created = run.createdEpoch;
    const keyOutlives = (obs.settings.leaseTtlMs * 2) / 3 - LOG_SLACK_MS;
    const ended = (e: (typeof epochs)[number]) => {
      if (e.token > (created ?? Infinity)) return e.start <= at + LOG_SLACK_MS;
      if (e.token !== created) return false;
      if (e.end + (e.diedLeading ? keyOutlives : 0) <= at + LOG_SLACK_MS) return true;
      // Frozen (SIGSTOP) while it led, long enough for its key to expire, by the skip.
      return obs.faults.some(
        (f) =>
          f.haltedAt !== undefined &&
          faultNodes(f).includes(e.node) &&
          f.start >= e.start - LOG_SLACK_MS &&
          f.start + keyOutlives <= Math.min(at, f.end),
      );
    };
    if (created === null || !epochs.some(ended))
      problems.push(
        `${label}, though its leader's epoch had not ended (no newer one had begun; it had not stepped down, died or frozen): a run whose leader stays is delayed, not dropped`,
      );
    // A run a catch-up made late was its to fire: late only from when it was made.
    const since = Math.max(run.scheduledFor, run.createdAt);
    if (at - since < threshold - LATE_FUZZ_MS)
      problems.push(`${label}, ${at - since} ms after it was due or made: under the threshold`);
    if (
      policies.includes('fire-once') &&
      !policies.includes('skip') &&
      !(runsByJob.get(run.jobId) ?? []).some(
        (o) =>
          o.scheduledFor > run.scheduledFor &&
          (o.scheduledFor < at - threshold + LATE_FUZZ_MS ||
            o.createdAt - o.scheduledFor > threshold - LATE_FUZZ_MS) &&
          misfirePolicies(job, o.scheduledFor, tolerance).some((p) => p.misfire !== 'skip'),
      )
    )
      problems.push(`${label}, with no later late occurrence to fire in its place`);
    if (!obs.faults.some((f) => f.start <= at && f.end + threshold + 3000 >= run.scheduledFor))
      problems.push(`${label}, with no fault near: no worker should have come that late`);
  }
  return problems;
}

/**
 * After the dispatcher was away longer than the threshold: `skip` creates no late run, `fire-once`
 * at most one per pass (and one after a gap it missed), `fire-all` at most maxCatchUp per pass. By
 * the policy in force when the occurrences fell due: a command catches up to its line by the old
 * policy (createDueRuns; its runs carry no epoch) and the dispatcher then goes on from there by
 * the new, so one pass applies one policy, which must be one in force at each run it made late.
 */
function checkMisfirePolicy(
  job: JobHistory,
  runs: RunRow[],
  excusedMisses: number[],
  obs: Observations,
): string[] {
  const problems: string[] = [];
  const policiesAt = (at: number) => misfirePolicies(job, at, obs.settings.opToleranceMs);
  const late = runs.filter((r) => r.createdEpoch !== null && isLate(r, obs));
  for (const [createdAt, group] of groupBy(late, (r) => r.createdAt)) {
    // Each run allows the pass at most what the most lenient policy in force at it allows.
    const allowed = Math.min(
      ...group.map((r) => Math.max(...policiesAt(r.scheduledFor).map(lateRunsAllowed))),
    );
    if (group.length > allowed)
      problems.push(
        `${job.name} (${describePolicies(distinctPolicies(group.flatMap((r) => policiesAt(r.scheduledFor))))}): one pass at ` +
          `${iso(createdAt)} created ${group.length} late runs (${group.map((r) => iso(r.scheduledFor)).join(', ')})`,
      );
  }
  if (excusedMisses.length > 0) {
    // The occurrences fired late after a gap are those right after the dropped ones, unless the
    // last one dropped may have been `skip`'s.
    const last = Math.max(...excusedMisses);
    const after = runs
      .filter((r) => r.scheduledFor > last)
      .sort((a, b) => a.scheduledFor - b.scheduledFor)[0];
    if (
      policiesAt(last).every((p) => lateRunsAllowed(p) > 0) &&
      after &&
      !(after.createdAt - after.scheduledFor > obs.settings.misfireThresholdMs - LATE_FUZZ_MS)
    )
      problems.push(
        `${job.name} (${describePolicies(policiesAt(last))}): occurrences up to ${iso(last)} were dropped but none was fired late ` +
          `(next run ${iso(after.scheduledFor)} created on time)`,
      );
  }
  return problems;
}
