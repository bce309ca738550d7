import type pg from 'pg';
import type { TargetRequest } from '../support/execution.js';
import type { ManagedProcess } from '../support/processes.js';
import { FAULTS_EXPLAINING_REDELIVERY, type FaultKind, type FaultRecord } from './faults.js';

export interface CheckInput {
  readonly pool: pg.Pool;
  readonly jobIds: string[];
  /** Every second in [windowStart, windowEnd] of every job must have exactly one run. */
  readonly windowStart: Date;
  readonly windowEnd: Date;
  readonly requests: readonly TargetRequest[];
  readonly faults: readonly FaultRecord[];
  readonly processes: readonly ManagedProcess[];
  /** How long after a fault its effects count towards that fault's lateness. */
  readonly settleMs: number;
}

export interface CheckResult {
  readonly violations: string[];
  readonly lines: string[];
}

/** Faults that can explain a second delivery: the worker died, froze, or could not record completion. */
const EXPLAINS_REDELIVERY: readonly FaultKind[] = FAULTS_EXPLAINING_REDELIVERY;

function percentile(values: number[], p: number): number {
  if (values.length === 0) return NaN;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
}

/** Compares what should have happened with what did. */
export async function check(input: CheckInput): Promise<CheckResult> {
  const violations: string[] = [];
  const lines: string[] = [];
  const { pool } = input;

  // 1. Every occurrence in the window has exactly one run row.
  const { rows: occurrence } = await pool.query<{ missing: number; duplicated: number; expected: number }>(
    `WITH expected AS (
       SELECT j, s FROM unnest($1::uuid[]) AS j, generate_series($2::timestamptz, $3::timestamptz, interval '1 second') AS s),
     counted AS (
       SELECT e.j, e.s, count(r.id)::int AS n FROM expected e
       LEFT JOIN runs r ON r.job_id = e.j AND r.scheduled_for = e.s GROUP BY e.j, e.s)
     SELECT count(*)::int AS expected, count(*) FILTER (WHERE n = 0)::int AS missing,
            count(*) FILTER (WHERE n > 1)::int AS duplicated FROM counted`,
    [input.jobIds, input.windowStart, input.windowEnd],
  );
  const { expected, missing, duplicated } = occurrence[0]!;
  lines.push(`occurrences expected ${expected}, missing ${missing}, with two or more runs ${duplicated}`);
  if (missing > 0) violations.push(`${missing} occurrences have no run`);
  if (duplicated > 0) violations.push(`${duplicated} occurrences have more than one run`);

  // 2. Every run of the window succeeded and reached the target; repeats only when explained.
  const { rows: runs } = await pool.query<{ id: string; state: string; scheduled_for: Date }>(
    `SELECT id, state, scheduled_for FROM runs WHERE job_id = ANY($1::uuid[]) AND scheduled_for BETWEEN $2 AND $3`,
    [input.jobIds, input.windowStart, input.windowEnd],
  );
  const byRun = new Map<string, TargetRequest[]>();
  for (const request of input.requests) {
    let list = byRun.get(request.runId);
    if (!list) byRun.set(request.runId, (list = []));
    list.push(request);
  }
  const notSucceeded = runs.filter((r) => r.state !== 'succeeded');
  const neverArrived = runs.filter((r) => !byRun.has(r.id));
  let repeated = 0;
  let unexplained = 0;
  for (const run of runs) {
    const deliveries = byRun.get(run.id) ?? [];
    if (deliveries.length < 2) continue;
    repeated += 1;
    const first = deliveries[0]!.arrivedAt;
    const last = deliveries.at(-1)!.arrivedAt;
    const explained = input.faults.some(
      (f) => EXPLAINS_REDELIVERY.includes(f.kind) && f.start <= last && f.end >= first - 1000,
    );
    if (!explained) {
      unexplained += 1;
      if (unexplained <= 5)
        violations.push(
          `run ${run.id} reached the target ${deliveries.length} times with no fault to explain it`,
        );
    }
  }
  lines.push(
    `runs ${runs.length}: not succeeded ${notSucceeded.length}, never reached the target ${neverArrived.length}, ` +
      `reached it more than once ${repeated} (unexplained ${unexplained})`,
  );
  if (notSucceeded.length > 0) {
    const states = new Map<string, number>();
    for (const r of notSucceeded) states.set(r.state, (states.get(r.state) ?? 0) + 1);
    violations.push(`runs not succeeded: ${[...states].map(([s, n]) => `${s} ${n}`).join(', ')}`);
  }
  if (neverArrived.length > 0) violations.push(`${neverArrived.length} runs never reached the target`);

  // 3. Nothing is left queued or running.
  const { rows: active } = await pool.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM runs WHERE job_id = ANY($1::uuid[]) AND state IN ('queued', 'running')`,
    [input.jobIds],
  );
  lines.push(`runs still queued or running after settling: ${active[0]!.n}`);
  if (active[0]!.n > 0) violations.push(`${active[0]!.n} runs still queued or running after settling`);

  // 4. Writes of fenced-off leaders were rejected.
  const rejections = input.processes.reduce(
    (n, p) =>
      n + p.logs.filter((l) => typeof l.msg === 'string' && l.msg.includes('rejected by the fence')).length,
    0,
  );
  const heldPauses = input.faults.filter((f) => f.kind === 'pause-leader' && f.heldWrite).length;
  lines.push(`fence rejections ${rejections} (pauses with a write held at the freeze: ${heldPauses})`);
  if (heldPauses > 0 && rejections === 0)
    violations.push('a paused leader woke up and no write was rejected by the fence');

  // 4b. In the data itself: no run created by an epoch after a newer epoch had created runs.
  const { rows: stale } = await pool.query<{ n: number }>(
    `WITH epochs AS (
       SELECT created_epoch AS token, min(created_at) AS first_write, max(created_at) AS last_write
       FROM runs WHERE job_id = ANY($1::uuid[]) AND created_epoch IS NOT NULL GROUP BY created_epoch)
     SELECT count(*)::int AS n FROM epochs old
     WHERE EXISTS (SELECT 1 FROM epochs newer WHERE newer.token > old.token AND newer.first_write < old.last_write)`,
    [input.jobIds],
  );
  lines.push(`epochs that wrote runs after a newer epoch had written: ${stale[0]!.n}`);
  if (stale[0]!.n > 0)
    violations.push(`${stale[0]!.n} fenced-off leader epochs had runs accepted after a newer leader wrote`);

  // 4c. No node died on its own: every exit was a kill the chaos schedule made.
  for (const process of input.processes) {
    if (process.exitedAt === undefined) continue;
    const killed = input.faults.some(
      (f) =>
        f.node === process.name &&
        f.haltedAt !== undefined &&
        Math.abs(f.haltedAt - process.exitedAt!) < 5000,
    );
    if (!killed) {
      violations.push(
        `node ${process.name} (pid ${process.pid}) exited on its own at ${new Date(process.exitedAt).toISOString()}; ` +
          `stderr (stack frames left out): ${withoutStackFrames(process.stderr).slice(-8).join(' | ')}`,
      );
    }
  }

  // 5. Never two leaders: each node's own view of its epochs, in token order, must not overlap.
  const epochs = leaderEpochs(input.processes, input.faults);
  for (let i = 1; i < epochs.length; i++) {
    const prev = epochs[i - 1]!;
    const next = epochs[i]!;
    if (prev.end > next.start) {
      const until = Number.isFinite(prev.end) ? new Date(prev.end).toISOString() : 'the end of the run';
      violations.push(
        `${prev.node} (token ${prev.token}) believed it led until ${until}, ` +
          `after ${next.node} (token ${next.token}) became leader at ${new Date(next.start).toISOString()}`,
      );
    }
  }
  lines.push(
    `leader epochs ${epochs.length}, overlapping ${violations.filter((v) => v.includes('believed')).length}`,
  );

  // 6. Lateness of first deliveries, per fault kind (runs due during a fault or its settling time).
  const firstArrival = new Map<string, TargetRequest>();
  for (const [runId, list] of byRun) firstArrival.set(runId, list[0]!);
  const lateness = new Map<string, number[]>();
  for (const run of runs) {
    const request = firstArrival.get(run.id);
    if (!request) continue;
    const due = run.scheduled_for.getTime();
    const fault = input.faults.find((f) => due >= f.start && due <= f.end + input.settleMs);
    const kind = fault?.kind ?? 'no fault';
    let list = lateness.get(kind);
    if (!list) lateness.set(kind, (list = []));
    list.push(request.arrivedAt - due);
  }
  lines.push('', 'lateness of the first delivery (HTTP arrival − scheduled_for), ms:');
  lines.push(
    `${'window'.padEnd(24)} ${'runs'.padStart(6)} ${'p50'.padStart(8)} ${'p99'.padStart(8)} ${'max'.padStart(8)}`,
  );
  for (const [kind, values] of [...lateness].sort()) {
    const fmt = (v: number) => v.toFixed(0).padStart(8);
    lines.push(
      `${kind.padEnd(24)} ${String(values.length).padStart(6)} ${fmt(percentile(values, 50))} ${fmt(percentile(values, 99))} ${fmt(Math.max(...values))}`,
    );
  }
  return { violations, lines };
}

interface Epoch {
  node: string;
  token: bigint;
  start: number;
  end: number;
}

/**
 * Leadership as each node saw it, from its logs: from 'became leader' to 'stepped down'. A node
 * killed or frozen stops believing anything at that instant (it cannot act; after SIGCONT its own
 * deadline check has already failed, and any write already past it meets the fence).
 */
function leaderEpochs(processes: readonly ManagedProcess[], faults: readonly FaultRecord[]): Epoch[] {
  const epochs: Epoch[] = [];
  for (const process of processes) {
    const halts = faults
      .filter((f) => f.haltedAt !== undefined && f.node === process.name)
      .map((f) => f.haltedAt!);
    let open: Epoch | undefined;
    for (const line of process.logs) {
      const at = Date.parse(String(line.time));
      if (line.msg === 'became leader') {
        open = { node: process.name, token: BigInt(String(line.token)), start: at, end: Infinity };
        epochs.push(open);
      } else if (line.msg === 'stepped down' && open) {
        open.end = at;
        open = undefined;
      }
    }
    for (const epoch of epochs.filter((e) => e.node === process.name)) {
      const halt = halts.find((h) => h >= epoch.start && h < epoch.end);
      if (halt !== undefined) epoch.end = halt;
    }
    // A process that died by itself believes nothing after its exit (reported as a violation above).
    if (open && process.exitedAt !== undefined && open.end > process.exitedAt) open.end = process.exitedAt;
  }
  // A process that is still running and leading at the end has an open epoch: fine if last.
  return epochs.sort((a, b) => (a.token < b.token ? -1 : a.token > b.token ? 1 : 0));
}

/** The lines of a crash report that say what happened, without its `at …` frames. */
function withoutStackFrames(lines: readonly string[]): string[] {
  return lines.filter((line) => line.trim() !== '' && !/^\s+at /.test(line));
}
