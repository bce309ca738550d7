/**
 * Runs and their deliveries: final states per kind of job, a second delivery only when a fault
 * hit the node that held that run's claim during that call, nothing early, lateness within the
 * bound of the fault it was due in, triggers and replays executed, each attempt of a dead run used
 * up by a failed call or a fault.
 */
import type { JobRole } from './model.js';
import {
  faultNodes,
  groupBy,
  iso,
  type AttemptRow,
  type Delivery,
  type Fault,
  type Findings,
  type Observations,
  type RunRow,
  report,
} from './observations.js';

/** Final states a run of each kind of job may end in (the target answers as the role says). */
const FINAL_STATES: Record<JobRole, readonly string[]> = {
  steady: ['succeeded'],
  ops: ['succeeded', 'skipped'],
  failing: ['dead', 'succeeded'],
  forbid: ['succeeded', 'skipped'],
  replace: ['succeeded', 'failed'],
};

/**
 * A graceful stop (SIGTERM) may cut only a call that was already in flight when its drain began: one
 * its worker started later must be able to end before the drain deadline. The drain begins after
 * the node has stopped its leader parts (resign, leader tasks), hence the allowance.
 */
export const STOP_DRAIN_BEGINS_WITHIN_MS = 1000;

/**
 * A fault explains a second call of one run when it hit the node that held the claim of the
 * first call while that call was open, or when it was server-wide and outlasted the claim. A
 * graceful stop explains it only for a call that had started when the stop began.
 */
export function explainingFault(
  faults: readonly Fault[],
  claimant: string | undefined,
  first: Delivery,
  second: Delivery,
  claimHoldMs: number,
): Fault | undefined {
  return faults.find((f) => {
    if (f.start > second.arrivedAt || f.end < first.arrivedAt - 500) return false;
    if (f.kind.startsWith('sigterm-') && first.arrivedAt > f.start + STOP_DRAIN_BEGINS_WITHIN_MS)
      return false;
    const nodes = faultNodes(f);
    if (nodes.length === 0) return f.end - f.start > claimHoldMs;
    return claimant !== undefined && nodes.includes(claimant);
  });
}

function lateness(
  obs: Observations,
  runs: readonly RunRow[],
  byRun: Map<string, Delivery[]>,
  roles: Map<string, JobRole>,
  attempts: ReadonlyMap<string, AttemptRow>,
) {
  const byKind = new Map<string, number[]>();
  const over: string[] = [];
  for (const run of runs) {
    const role = roles.get(run.jobId);
    if (run.trigger !== 'schedule' || (role !== 'steady' && role !== 'ops')) continue;
    if (run.scheduledFor < obs.windowStart || run.scheduledFor > obs.windowEnd) continue;
    const first = byRun.get(run.id)?.[0];
    if (!first) continue;
    const due = run.scheduledFor;
    const fault = obs.faults.find((f) => due >= f.start - 1000 && due <= f.end + obs.settings.settleMs);
    const kind = fault?.kind ?? 'no fault';
    const late = first.arrivedAt - due;
    // The first call of a later attempt: each earlier one ended without a call (its claimant was
    // killed or stopped with the run claimed ahead). One that expired may have held the run until
    // its claim did (the due instant + timeout + grace) and the reaper's next pass took it back;
    // one handed back (`cancelled`) was announced again at once. The figures by kind are of first
    // attempts, as they always were.
    const lost = first.attempt - 1;
    let expired = 0;
    for (let n = 1; n <= lost; n++) if (attempts.get(`${run.id}/${n}`)?.outcome !== 'cancelled') expired += 1;
    const held = expired * (run.timeoutMs + obs.settings.claimGraceMs + obs.settings.reaperIntervalMs);
    if (lost === 0) {
      let list = byKind.get(kind);
      if (!list) byKind.set(kind, (list = []));
      list.push(late);
    }
    const { deadline, by } = lost > 0 ? reapedLate(obs, due, held, kind) : latestArrival(obs, due, kind);
    if (first.arrivedAt > deadline)
      over.push(
        `run ${run.id} due ${iso(due)} arrived ${late.toFixed(0)} ms late (${kind}, bound ` +
          `${boundOf(obs, kind)} ms${by.length > 0 ? `, then ${by.join(', ')}` : ''}` +
          `${lost > 0 ? `, first called as attempt ${first.attempt}: ${held} ms for the claims lost before it` : ''})`,
      );
  }
  return { byKind, over };
}

/** The latest a run due at `due` may first arrive (latestArrival with the kind of fault it was due in). */
export function arrivalDeadline(obs: Observations, due: number): number {
  const fault = obs.faults.find((f) => due >= f.start - 1000 && due <= f.end + obs.settings.settleMs);
  return latestArrival(obs, due, fault?.kind ?? 'no fault').deadline;
}

/**
 * Faults during which no node leads: etcd as a whole away or restarting. The reaper runs on the
 * leader, so a claim lost meanwhile is taken back only after the fault, an election and a pass.
 */
const WITHOUT_LEADER = new Set(['etcd-down-30s', 'restart-etcd']);

/**
 * The latest a run whose claims were lost (first called as a later attempt) may first arrive:
 * latestArrival counted from when its lost claims may have held it (`held`), or, when a fault
 * during which nothing reaps overlaps that wait, from that fault's end: a lease, a reaper pass,
 * then the run's own bound.
 */
function reapedLate(obs: Observations, due: number, held: number, kind: string) {
  const arrival = latestArrival(obs, due + held, kind);
  // In the order they began, as latestArrival takes them: an extension may bring a later fault in.
  for (const f of [...obs.faults].sort((a, b) => a.start - b.start)) {
    if (!WITHOUT_LEADER.has(f.kind) || f.end + obs.settings.settleMs < due) continue;
    if (f.start - 1000 > arrival.deadline) continue;
    const after = f.end + obs.settings.leaseTtlMs + obs.settings.reaperIntervalMs + boundOf(obs, kind);
    if (after <= arrival.deadline) continue;
    arrival.deadline = after;
    if (!arrival.by.includes(f.kind)) arrival.by.push(f.kind);
  }
  return arrival;
}

function boundOf(obs: Observations, kind: string): number {
  return obs.settings.latenessBoundMs[kind] ?? obs.settings.latenessBoundMs.default ?? Infinity;
}

/**
 * The latest a run due at `due` may first arrive: its bound, by the kind of fault it was due in;
 * and when another fault is on (or begins) while the run may still legitimately be waiting, the run
 * may wait for that one too, its bound counted from when it began (less the second the due window
 * allows) or from `due`: a run held up by one fault's recovery when PostgreSQL then goes away waits
 * for all of the outage. Returns the deadline and the kinds that extended it.
 */
export function latestArrival(
  obs: Observations,
  due: number,
  kind: string,
): { deadline: number; by: string[] } {
  let deadline = due + boundOf(obs, kind);
  const by: string[] = [];
  for (const f of [...obs.faults].sort((a, b) => a.start - b.start)) {
    if (f.end + obs.settings.settleMs < due) continue; // over before the run was due
    const from = Math.max(due, f.start - 1000);
    if (from > deadline) continue;
    const extended = from + boundOf(obs, f.kind);
    if (extended > deadline) {
      deadline = extended;
      if (f.kind !== kind) by.push(f.kind);
    }
  }
  return { deadline, by };
}

function percentile(values: number[], p: number): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))] ?? NaN;
}

/**
 * A dead run's attempts that were used up neither by a call the (failing) target answered 500 nor
 * by a claim that expired while a fault hit its claimant. Checked per attempt, not against
 * `max_attempts`: a claim handed back (outcome `cancelled`) or an expiry the reaper forgave
 * re-queues the run without using up an attempt by raising `max_attempts`, so a run may die after
 * more attempts than calls. An attempt
 * claimed ahead starts at its run's time (its row's `started_at`), up to the claim lead after its
 * claim: a fault from then on may have cut it (a worker killed while the run waited for its time).
 */
function unfailedAttempts(
  obs: Observations,
  run: RunRow,
  calls: readonly Delivery[],
  attempts: ReadonlyMap<string, AttemptRow>,
): string[] {
  const failedAtTarget = new Set(calls.filter((c) => c.status === 500).map((c) => c.attempt));
  const found: string[] = [];
  for (let n = 1; n <= run.attempt; n++) {
    if (failedAtTarget.has(n)) continue;
    const row = attempts.get(`${run.id}/${n}`);
    if (row?.outcome === 'cancelled') continue;
    const from = (row?.startedAt ?? run.scheduledFor) - obs.settings.claimLeadMs - 500;
    const to = row?.finishedAt ?? run.finishedAt ?? Infinity;
    // Only an expiry: a worker killed, frozen or cut off while it held the claim. An attempt
    // recorded `failed` was settled by its worker, after a call that should have reached the target.
    const excused =
      row?.outcome === 'expired' &&
      obs.faults.some((f) => faultNodes(f).includes(row.nodeId) && f.start <= to && f.end >= from);
    if (!excused)
      found.push(
        `run ${run.id} is dead after ${run.attempt} attempts of ${run.maxAttempts}; attempt ${n} ` +
          `(${row ? `${row.outcome ?? 'no outcome'} on ${row.nodeId}` : 'no attempt row'}) was used up ` +
          `without a call failing at the target or a fault on its claimant`,
      );
  }
  return found;
}

export function checkRuns(obs: Observations): Findings {
  const violations: string[] = [];
  const lines: string[] = [];
  const roles = new Map(obs.jobs.map((j) => [j.id, j.role]));
  const runById = new Map(obs.runs.map((r) => [r.id, r]));
  const byRun = groupBy(
    [...obs.deliveries].sort((a, b) => a.arrivedAt - b.arrivedAt),
    (d) => d.runId,
  );
  const attempts = new Map(obs.attempts.map((a) => [`${a.runId}/${a.attempt}`, a]));
  const existingJobs = new Set(obs.runs.map((r) => r.jobId));

  const active: string[] = [];
  const badState: string[] = [];
  const neverCalled: string[] = [];
  const sameAttempt: string[] = [];
  const unexplained: string[] = [];
  const early: string[] = [];
  const vanished: string[] = [];
  const budget: string[] = [];
  let repeated = 0;

  for (const run of obs.runs) {
    const role = roles.get(run.jobId);
    if (!role) continue;
    const calls = byRun.get(run.id) ?? [];
    if (run.state === 'queued' || run.state === 'running') {
      active.push(`run ${run.id} of ${role} job is still ${run.state} after settling`);
      continue;
    }
    // A misfire skipped at its claim may end any job's run (judged in check-occurrences.ts).
    const misfire = run.state === 'skipped' && run.reason === 'misfire';
    if (
      !misfire &&
      (!FINAL_STATES[role].includes(run.state) || (run.state === 'failed' && run.reason !== 'replaced'))
    )
      badState.push(
        `run ${run.id} (${role}, due ${iso(run.scheduledFor)}) ended ${run.state} (${run.reason ?? 'no reason'})`,
      );
    // A replaced run may be replaced before its call starts; a skipped one never calls.
    if (calls.length === 0 && run.state !== 'skipped' && !(role === 'replace' && run.reason === 'replaced'))
      neverCalled.push(
        `run ${run.id} (${role}, due ${iso(run.scheduledFor)}) ended ${run.state} without reaching the target`,
      );
    const first = calls[0];
    if (first && first.arrivedAt < run.scheduledFor - obs.settings.earlyToleranceMs)
      early.push(
        `run ${run.id} due ${iso(run.scheduledFor)} arrived ${(run.scheduledFor - first.arrivedAt).toFixed(0)} ms early`,
      );
    const seen = new Set<number>();
    for (let i = 0; i < calls.length; i++) {
      const call = calls[i]!;
      const claimant = attempts.get(`${run.id}/${call.attempt}`)?.nodeId;
      if (seen.has(call.attempt))
        sameAttempt.push(
          `run ${run.id} attempt ${call.attempt} reached the target twice (claimant ${claimant ?? '?'})`,
        );
      seen.add(call.attempt);
      const next = calls[i + 1];
      // A call the target answered with a failure is retried by design; any other repeat is a redelivery.
      if (!next || (call.status !== undefined && call.status >= 300 && !call.aborted)) continue;
      repeated += 1;
      const hold = run.timeoutMs + obs.settings.claimGraceMs;
      if (!explainingFault(obs.faults, claimant, call, next, hold))
        unexplained.push(
          `run ${run.id} (${role}) attempt ${call.attempt} on ${claimant ?? '?'} at ${iso(call.arrivedAt)} ` +
            `${call.aborted ? 'aborted' : `answered ${call.status}`}, called again as attempt ${next.attempt} at ` +
            `${iso(next.arrivedAt)}, with no fault on ${claimant ?? 'its claimant'}`,
        );
    }
    if (run.state === 'dead') budget.push(...unfailedAttempts(obs, run, calls, attempts));
  }
  // Deliveries of runs that are not in the database: only jobs deleted meanwhile lose their runs.
  for (const [runId, calls] of byRun) {
    if (runById.has(runId)) continue;
    const job = obs.jobs.find((j) => j.id === calls[0]!.jobId);
    const deleted = job?.versions.some((v) => !v.exists);
    if (!deleted || existingJobs.has(calls[0]!.jobId))
      vanished.push(`run ${runId} of ${job?.name ?? calls[0]!.jobId} reached the target but has no row`);
  }

  const { byKind, over } = lateness(obs, obs.runs, byRun, roles, attempts);
  lines.push(
    `runs ${obs.runs.length}: still active ${active.length}, unexpected final state ${badState.length}, ` +
      `never reached the target ${neverCalled.length}, called again after a call that did not fail ${repeated} ` +
      `(unexplained ${unexplained.length}), an attempt called twice ${sameAttempt.length}, early ${early.length}`,
  );
  report(violations, 'runs still queued or running after settling', active);
  report(violations, 'runs ended in a state their job cannot explain', badState);
  report(violations, 'runs ended without reaching the target', neverCalled);
  report(violations, 'redeliveries with no fault on the node that held the claim', unexplained);
  report(violations, 'attempts that reached the target twice', sameAttempt);
  report(violations, 'calls that arrived before their scheduled_for', early);
  report(violations, 'deliveries of runs missing from the database', vanished);
  report(violations, 'dead runs that used attempts without calling', budget);
  report(violations, 'first deliveries later than the bound of their fault kind', over);

  lines.push('', 'lateness of the first delivery (HTTP arrival − scheduled_for), steady and ops jobs, ms:');
  lines.push(
    `${'window'.padEnd(24)} ${'runs'.padStart(6)} ${'p50'.padStart(8)} ${'p99'.padStart(8)} ${'max'.padStart(8)} ${'bound'.padStart(8)}`,
  );
  for (const [kind, values] of [...byKind].sort()) {
    const fmt = (v: number) => v.toFixed(0).padStart(8);
    const bound = obs.settings.latenessBoundMs[kind] ?? obs.settings.latenessBoundMs.default ?? Infinity;
    lines.push(
      `${kind.padEnd(24)} ${String(values.length).padStart(6)} ${fmt(percentile(values, 50))} ${fmt(percentile(values, 99))} ${fmt(Math.max(...values))} ${fmt(bound)}`,
    );
  }
  return { violations, lines };
}
