/**
 * Leadership. What is promised (README): a leader stops at its own monotonic deadline, and a
 * leader that was paused or partitioned writes nothing once a newer leader has written. So:
 * - in the data, no epoch's run was created after a newer epoch had created one;
 * - in the logs, epochs in order of their start have growing tokens, and a node that was not
 *   frozen stepped down before the next leader began; a frozen node (SIGSTOP) may still believe
 *   it leads while frozen (it cannot act), but steps down as soon as it runs again;
 * - a paused leader's held write is rejected by the fence, in that node's log, after its resume;
 * - no node exited except by a kill of the schedule.
 */
import {
  faultNodes,
  iso,
  type Fault,
  type Findings,
  type Observations,
  type ProcessView,
} from './observations.js';

/** A transaction's created_at is its start; a write that began before the newer epoch's fence may commit after it. */
const COMMIT_SLACK_MS = 500;
/** Log timestamps of two processes on one host, and the time from a step-down decision to its log line. */
const LOG_SLACK_MS = 250;
/** A frozen node steps down this soon after it runs again (its deadline has long passed). */
const WAKE_SLACK_MS = 1500;

interface Epoch {
  readonly node: string;
  readonly pid: number;
  readonly token: bigint;
  readonly start: number;
  /** When its node stepped down (logged) or died. */
  end: number;
  /** True when it died leading (killed): its leader key outlived it until its lease expired. */
  diedLeading?: boolean;
}

export function leaderEpochs(processes: readonly ProcessView[]): Epoch[] {
  const epochs: Epoch[] = [];
  for (const process of processes) {
    let open: Epoch | undefined;
    for (const line of process.logs) {
      const at = Date.parse(String(line.time));
      if (line.msg === 'became leader') {
        open = {
          node: process.name,
          pid: process.pid,
          token: BigInt(String(line.token)),
          start: at,
          end: Infinity,
        };
        epochs.push(open);
      } else if (line.msg === 'stepped down' && open) {
        open.end = at;
        open = undefined;
      }
    }
    // A killed process believes nothing after its death.
    if (open && process.exitedAt !== undefined) {
      open.end = process.exitedAt;
      open.diedLeading = true;
    }
  }
  return epochs.sort((a, b) => a.start - b.start);
}

/** Was `node` frozen (SIGSTOP, not killed) at `at`? Returns the pause fault. */
function frozenAt(faults: readonly Fault[], processes: readonly ProcessView[], node: string, at: number) {
  return faults.find(
    (f) =>
      f.haltedAt !== undefined &&
      faultNodes(f).includes(node) &&
      f.start <= at &&
      at <= f.end &&
      // a kill leaves an exit at the halt; a pause does not
      !processes.some(
        (p) => p.name === node && p.exitedAt !== undefined && Math.abs(p.exitedAt - f.haltedAt!) < 5000,
      ),
  );
}

export function checkLeaders(obs: Observations): Findings {
  const violations: string[] = [];
  const lines: string[] = [];

  // 1. The data: per epoch, its first and last run creation.
  const writes = new Map<bigint, { first: number; last: number }>();
  for (const run of obs.runs) {
    if (run.createdEpoch === null) continue;
    const w = writes.get(run.createdEpoch);
    if (!w) writes.set(run.createdEpoch, { first: run.createdAt, last: run.createdAt });
    else {
      w.first = Math.min(w.first, run.createdAt);
      w.last = Math.max(w.last, run.createdAt);
    }
  }
  const tokens = [...writes.keys()].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  let stale = 0;
  for (let i = 0; i < tokens.length; i++) {
    const old = writes.get(tokens[i]!)!;
    for (let j = i + 1; j < tokens.length; j++) {
      const newer = writes.get(tokens[j]!)!;
      if (old.last > newer.first + COMMIT_SLACK_MS) {
        stale += 1;
        violations.push(
          `epoch ${tokens[i]} created a run at ${iso(old.last)}, after epoch ${tokens[j]} had created one at ${iso(newer.first)}`,
        );
        break;
      }
    }
  }
  lines.push(`epochs that wrote runs ${tokens.length}; of them wrote after a newer epoch ${stale}`);

  // 2. The logs.
  const epochs = leaderEpochs(obs.processes);
  let overlaps = 0;
  for (let i = 1; i < epochs.length; i++) {
    const prev = epochs[i - 1]!;
    const next = epochs[i]!;
    if (next.token <= prev.token)
      violations.push(
        `${next.node} became leader with token ${next.token} after ${prev.node} had token ${prev.token}`,
      );
    if (prev.end <= next.start + LOG_SLACK_MS) continue;
    const pause = frozenAt(obs.faults, obs.processes, prev.node, next.start);
    if (pause && prev.end <= pause.end + WAKE_SLACK_MS) continue;
    overlaps += 1;
    const until = Number.isFinite(prev.end) ? iso(prev.end) : 'the end of the run';
    violations.push(
      `${prev.node} (token ${prev.token}) believed it led until ${until}, after ${next.node} (token ${next.token}) ` +
        `became leader at ${iso(next.start)}${pause ? `; it was resumed at ${iso(pause.end)}` : ' and it was not frozen'}`,
    );
  }
  lines.push(`leader epochs ${epochs.length}, overlapping beyond what a freeze explains ${overlaps}`);

  // 3. The fence after each pause that held a write.
  for (const fault of obs.faults.filter((f) => f.kind === 'pause-leader' && f.heldWrite)) {
    const process = obs.processes.find(
      (p) => p.name === fault.node && firstLogAt(p) <= fault.start && (p.exitedAt ?? Infinity) >= fault.end,
    );
    const rejected = process?.logs.some((l) => {
      const at = Date.parse(String(l.time));
      return (
        typeof l.msg === 'string' &&
        l.msg.includes('rejected by the fence') &&
        at >= fault.end - LOG_SLACK_MS &&
        at <= fault.end + 10_000
      );
    });
    lines.push(
      `pause of ${fault.node} at ${iso(fault.start)} with a write held: rejected by the fence after resume: ${rejected ? 'yes' : 'no'}`,
    );
    if (!rejected)
      violations.push(
        `${fault.node} was paused with a write held and, after its resume at ${iso(fault.end)}, logged no fence rejection`,
      );
  }

  // 4. No node died on its own.
  for (const process of obs.processes) {
    if (process.exitedAt === undefined) continue;
    const killed = obs.faults.some(
      (f) =>
        faultNodes(f).includes(process.name) &&
        f.haltedAt !== undefined &&
        Math.abs(f.haltedAt - process.exitedAt!) < 5000,
    );
    if (!killed) {
      const said = (process.stderr ?? []).filter((line) => line.trim() !== '' && !/^\s+at /.test(line));
      violations.push(
        `node ${process.name} (pid ${process.pid}) exited on its own at ${iso(process.exitedAt)}; ` +
          `stderr (stack frames left out): ${said.slice(-8).join(' | ')}`,
      );
    }
  }
  return { violations, lines };
}

function firstLogAt(process: ProcessView): number {
  const first = process.logs.find((l) => l.time !== undefined);
  return first ? Date.parse(String(first.time)) : Infinity;
}
