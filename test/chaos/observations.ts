/**
 * What the checker judges, as plain arrays (loaded from PostgreSQL, the target server, Kafka and
 * the nodes' logs by checker.ts), so every check is a pure function that a unit test can feed
 * crafted data (test/chaos/checker.test.ts).
 */
import type { JobHistory, JobVersion } from './model.js';

/** Times are wall-clock ms since the epoch. */
export interface RunRow {
  readonly id: string;
  readonly jobId: string;
  readonly scheduledFor: number;
  readonly trigger: 'schedule' | 'manual';
  readonly state: string;
  readonly attempt: number;
  readonly maxAttempts: number;
  readonly reason: string | null;
  readonly concurrency: string;
  readonly createdEpoch: bigint | null;
  readonly createdAt: number;
  readonly startedAt: number | null;
  readonly finishedAt: number | null;
  readonly timeoutMs: number;
}

export interface AttemptRow {
  readonly runId: string;
  readonly attempt: number;
  readonly nodeId: string;
  readonly startedAt: number;
  readonly finishedAt: number | null;
  readonly outcome: string | null;
}

export interface DeadLetterRow {
  readonly id: string;
  readonly runId: string;
  readonly jobId: string;
  readonly attempt: number;
  readonly replayedAt: number | null;
}

/** One HTTP request the target received. */
export interface Delivery {
  readonly runId: string;
  readonly jobId: string;
  readonly attempt: number;
  /** X-Helios-Scheduled-For, parsed. */
  readonly scheduledFor: number;
  readonly path: string;
  readonly arrivedAt: number;
  readonly endedAt?: number;
  readonly status?: number;
  readonly aborted?: boolean;
}

/** An injected fault (a FaultRecord of faults.ts, or anything shaped like one). */
export interface Fault {
  readonly kind: string;
  readonly node?: string;
  /** Every node the fault hit, when it hit more than one (a partition). */
  readonly nodes?: readonly string[];
  readonly start: number;
  readonly end: number;
  readonly haltedAt?: number;
  readonly heldWrite?: boolean;
}

/** One node process with its JSON log lines (ManagedProcess fits). */
export interface ProcessView {
  readonly name: string;
  readonly pid: number;
  readonly logs: readonly Record<string, unknown>[];
  readonly exitedAt?: number;
  readonly stderr?: readonly string[];
}

/** One API operation of the nemesis, as the checker needs it (see operations.ts). */
export interface OpView {
  readonly kind: string;
  readonly jobId?: string;
  readonly jobName?: string;
  readonly sentAt: number;
  readonly answeredAt: number;
  /** 'ok': the API answered with success; 'unknown': no answer (may or may not have happened). */
  readonly outcome: 'ok' | 'unknown' | 'refused';
  /** trigger and replay: the run id the API returned. */
  readonly runId?: string;
  /** replay: the attempt the dead letter recorded. */
  readonly deadAttempt?: number;
  /** Some try got no answer: it may still land (a frozen node serves it when it runs again). */
  readonly lostTry?: boolean;
  /** create: the job it asked for (a try that got no answer may make it late: check-unknown-jobs.ts). */
  readonly plan?: Pick<JobHistory, 'role'> & Omit<JobVersion, 'from0' | 'from1' | 'cause'>;
}

export interface Settings {
  readonly misfireThresholdMs: number;
  readonly lookaheadMs: number;
  /** Added to a run's timeout to make its claim deadline (HELIOS_CLAIM_GRACE_MS). */
  readonly claimGraceMs: number;
  /** How long before its time a worker claims a run (HELIOS_CLAIM_LEAD_MS). */
  readonly claimLeadMs: number;
  /** Longest pause between the reaper's passes over expired claims (HELIOS_REAPER_INTERVAL_MS). */
  readonly reaperIntervalMs: number;
  readonly leaseTtlMs: number;
  /** How far around an operation's [sentAt, answeredAt] an occurrence may see either side. */
  readonly opToleranceMs: number;
  /** How early an HTTP call may arrive before its scheduled_for (clock estimate). */
  readonly earlyToleranceMs: number;
  /** Longest first-delivery lateness accepted, by the fault kind whose window the run was due in. */
  readonly latenessBoundMs: Readonly<Record<string, number>>;
  /** How long after a fault's end its effects count towards that fault (lateness). */
  readonly settleMs: number;
}

export interface Observations {
  readonly windowStart: number;
  readonly windowEnd: number;
  readonly jobs: readonly JobHistory[];
  readonly runs: readonly RunRow[];
  /**
   * The runs of each job the nemesis deleted, as they were just before the delete (which takes
   * them with the job). Only the occurrence checks read them: they say why an occurrence of a job
   * deleted later made no call (a misfire skipped at a claim, judged as any other; fire-once's fired
   * run). A `forbid` or `replace` skip among them excuses nothing: check-policies.ts never judges
   * it. Default none.
   */
  readonly runsOfDeletedJobs?: readonly RunRow[];
  readonly attempts: readonly AttemptRow[];
  readonly deadLetters: readonly DeadLetterRow[];
  readonly deliveries: readonly Delivery[];
  readonly faults: readonly Fault[];
  readonly processes: readonly ProcessView[];
  readonly ops: readonly OpView[];
  /**
   * The jobs in the database at the end that no answer of the API named (check-unknown-jobs.ts
   * judges them; their rows are in `runs`, `attempts` and `deadLetters`). Default none.
   */
  readonly unknownJobs?: readonly { readonly id: string; readonly name: string }[];
  readonly settings: Settings;
}

/**
 * `runs` (the database at the end) and the rows of `readBeforeDeletes` that are not in it (their
 * job was deleted): a row still in the database wins (a delete that was refused left the job and
 * its runs), and of a run read twice the later read.
 */
export function withRunsReadBeforeDeletes(
  runs: readonly RunRow[],
  readBeforeDeletes: readonly RunRow[],
): RunRow[] {
  const present = new Set(runs.map((r) => r.id));
  const gone = new Map(readBeforeDeletes.filter((r) => !present.has(r.id)).map((r) => [r.id, r]));
  return [...runs, ...gone.values()];
}

/** What a check found: violations fail the run; lines are the report. */
export interface Findings {
  readonly violations: string[];
  readonly lines: string[];
}

/** Report at most this many lines per kind of violation (the count is always reported). */
const SHOWN = 5;

/** Adds `items` to `violations` under `label`: their count, and the first SHOWN of them. */
export function report(violations: string[], label: string, items: string[]): void {
  if (items.length === 0) return;
  violations.push(`${items.length} ${label}:`);
  for (const item of items.slice(0, SHOWN)) violations.push(`    ${item}`);
  if (items.length > SHOWN) violations.push(`    … and ${items.length - SHOWN} more`);
}

export function iso(ms: number): string {
  return new Date(ms).toISOString();
}

/** Groups `items` by `key`. */
export function groupBy<T, K>(items: readonly T[], key: (item: T) => K): Map<K, T[]> {
  const groups = new Map<K, T[]>();
  for (const item of items) {
    const k = key(item);
    let list = groups.get(k);
    if (!list) groups.set(k, (list = []));
    list.push(item);
  }
  return groups;
}

/** The nodes a fault hit (none: a server-wide fault such as a PostgreSQL restart). */
export function faultNodes(fault: Fault): readonly string[] {
  return fault.nodes ?? (fault.node ? [fault.node] : []);
}
