import { readdirSync, readFileSync } from 'node:fs';
import type pg from 'pg';

/**
 * Samples pg_stat_activity of one database while a benchmark runs: how many backends were active,
 * on what wait, running which statement. Counts are samples, so a row's share of all samples is
 * the share of time a backend spent there.
 */
export class ActivitySampler {
  private readonly counts = new Map<string, number>();
  private samples = 0;
  private timer?: NodeJS.Timeout;

  constructor(
    private readonly pool: pg.Pool,
    private readonly database: string,
    private readonly everyMs = 20,
  ) {}

  start(): void {
    const tick = async () => {
      try {
        const { rows } = await this.pool.query<{ state: string; wait: string | null; query: string }>(
          `SELECT state, wait_event_type || ':' || wait_event AS wait, left(regexp_replace(query, '\\s+', ' ', 'g'), 90) AS query
           FROM pg_stat_activity
           WHERE datname = $1 AND pid <> pg_backend_pid() AND state NOT IN ('idle')`,
          [this.database],
        );
        this.samples++;
        for (const row of rows) {
          const key = `${row.state.padEnd(19)} ${(row.wait ?? 'CPU').padEnd(28)} ${row.query}`;
          this.counts.set(key, (this.counts.get(key) ?? 0) + 1);
        }
      } catch {
        // The database is being dropped, or the pool closed: sampling just ends.
      }
      this.timer = setTimeout(() => void tick(), this.everyMs);
    };
    void tick();
  }

  stop(): void {
    clearTimeout(this.timer);
  }

  /** The `top` most frequent (state, wait, statement), as "mean active backends" per row. */
  report(top = 15): string {
    const rows = [...this.counts.entries()].sort((a, b) => b[1] - a[1]).slice(0, top);
    return rows
      .map(([key, n]) => `  ${(n / Math.max(1, this.samples)).toFixed(2).padStart(5)}  ${key}`)
      .join('\n');
  }
}

interface CpuProfile {
  nodes: {
    id: number;
    callFrame: { functionName: string; url: string; lineNumber: number };
    children?: number[];
  }[];
  startTime: number;
  endTime: number;
  samples: number[];
  timeDeltas: number[];
}

/** Which package a frame belongs to: a node_modules package, Helios (`dist/<folder>`), or node. */
function packageOf(url: string, functionName: string): string {
  if (!url) return functionName.startsWith('(') ? functionName : '(native)';
  const nm = /node_modules\/((?:@[^/]+\/)?[^/]+)/.exec(url);
  if (nm) return nm[1]!;
  const dist = /\/dist\/(?:([^/]+)\/)?[^/]+\.js/.exec(url);
  if (dist) return `helios/${dist[1] ?? '(root)'}`;
  return url.startsWith('node:') ? 'node internals' : url;
}

/**
 * Summaries of the V8 CPU profiles in `dir` (one block per file): self time by package (where the
 * CPU went) and inclusive time of Helios functions (which part of Helios caused it). Sampled wall
 * time: on an overloaded machine a process waiting for a core still counts, so compare shares.
 */
export function summariseCpuProfiles(dir: string, top = 12): string {
  const out: string[] = [];
  for (const file of readdirSync(dir).filter((f) => f.endsWith('.cpuprofile'))) {
    const profile = JSON.parse(readFileSync(`${dir}/${file}`, 'utf8')) as CpuProfile;
    const byId = new Map(profile.nodes.map((n) => [n.id, n]));
    const parent = new Map<number, number>();
    for (const n of profile.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
    const selfByPackage = new Map<string, number>();
    const inclusive = new Map<string, number>();
    let busy = 0;
    profile.samples.forEach((leaf, i) => {
      const weight = (profile.timeDeltas[i + 1] ?? profile.timeDeltas[i] ?? 0) / 1000;
      const frame = byId.get(leaf)!.callFrame;
      if (frame.functionName === '(idle)') return;
      busy += weight;
      const pkg = packageOf(frame.url, frame.functionName);
      selfByPackage.set(pkg, (selfByPackage.get(pkg) ?? 0) + weight);
      const seen = new Set<string>();
      for (let id: number | undefined = leaf; id !== undefined; id = parent.get(id)) {
        const { functionName, url, lineNumber } = byId.get(id)!.callFrame;
        const dist = url.includes('node_modules') ? null : /\/dist\/(.+\.js)$/.exec(url);
        if (!dist) continue;
        const key = `${functionName || '(anonymous)'} ${dist[1]}:${lineNumber + 1}`;
        if (seen.has(key)) continue;
        seen.add(key);
        inclusive.set(key, (inclusive.get(key) ?? 0) + weight);
      }
    });
    const totalMs = (profile.endTime - profile.startTime) / 1000;
    const fmt = (map: Map<string, number>) =>
      [...map.entries()]
        .sort((a, b) => b[1] - a[1])
        .slice(0, top)
        .map(
          ([key, msUsed]) =>
            `    ${msUsed.toFixed(0).padStart(6)} ms ${((msUsed / busy) * 100).toFixed(0).padStart(3)}%  ${key}`,
        );
    out.push(`${file}: ${totalMs.toFixed(0)} ms profiled, ${busy.toFixed(0)} ms not idle`);
    out.push('  self time by package:', ...fmt(selfByPackage));
    out.push('  inclusive time of Helios functions:', ...fmt(inclusive));
  }
  return out.join('\n');
}

/** CPU seconds (user + system), command and parent of every process, from /proc/<pid>/stat. */
function processes(): Map<number, { comm: string; ppid: number; seconds: number }> {
  const ticks = 100; // USER_HZ on Linux
  const out = new Map<number, { comm: string; ppid: number; seconds: number }>();
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const stat = readFileSync(`/proc/${entry}/stat`, 'utf8');
      const close = stat.lastIndexOf(')');
      const comm = stat.slice(stat.indexOf('(') + 1, close);
      const fields = stat.slice(close + 2).split(' ');
      out.set(Number(entry), {
        comm,
        ppid: Number(fields[1]),
        seconds: (Number(fields[11]) + Number(fields[12])) / ticks,
      });
    } catch {
      // The process ended between readdir and read.
    }
  }
  return out;
}

function cmdline(pid: number): string {
  try {
    return readFileSync(`/proc/${pid}/cmdline`, 'utf8').replaceAll('\0', ' ');
  } catch {
    return '';
  }
}

/** Who the benchmark's own processes are, for {@link CpuMeter}. */
export interface CpuGroups {
  /** Named pids: the bench itself and each node (or peer process). */
  readonly named: Map<number, string>;
  /** The repository root: its `.helios/kafka` broker and `.helios/pg` cluster are the bench's. */
  readonly repoRoot: string;
  /** Backend pids serving the benchmark's database (pg_stat_activity), read at the end. */
  readonly backends: () => Promise<number[]>;
  /** Count our Kafka and etcd as the bench's (default true; the peers use neither: "other" then). */
  readonly brokers?: boolean;
}

/** CPU seconds per process group over one window; see {@link CpuMeter}. */
export interface CpuSample {
  readonly wallS: number;
  readonly cores: number;
  /** CPU seconds per group, as named by {@link CpuMeter} (e.g. `node bench-0`, `kafka`). */
  readonly groups: Record<string, number>;
}

/** The coarse categories CPU per run is reported in, in this order. */
export const CPU_CATEGORIES = ['nodes', 'postgresql', 'kafka', 'etcd', 'target', 'peer', 'other'] as const;
export type CpuCategory = (typeof CPU_CATEGORIES)[number];

/** Which category a {@link CpuSample} group belongs to. */
function categoryOf(group: string): CpuCategory {
  if (group.startsWith('node ')) return 'nodes';
  if (group.startsWith('postgres')) return 'postgresql';
  if (group === 'kafka' || group === 'etcd') return group;
  if (group.startsWith('bench')) return 'target';
  if (group.startsWith('peer')) return 'peer';
  return 'other';
}

/**
 * CPU milliseconds per run by category (nodes = all nodes; postgresql = the bench database's
 * backends and the cluster's shared processes; target = the benchmark process, which holds the
 * recording target; other = everything else on the shared machine), plus `total` of our own
 * processes (other left out: it is not ours).
 */
export function cpuPerRun(sample: CpuSample, runs: number): Record<CpuCategory | 'total', number> {
  const out = Object.fromEntries([...CPU_CATEGORIES, 'total'].map((c) => [c, 0])) as Record<
    CpuCategory | 'total',
    number
  >;
  for (const [group, seconds] of Object.entries(sample.groups)) {
    const category = categoryOf(group);
    const msPerRun = (seconds * 1000) / Math.max(1, runs);
    out[category] += msPerRun;
    if (category !== 'other') out.total += msPerRun;
  }
  return out;
}

/** One line: "nodes 0.55, postgresql 0.27, … = 0.93 ms CPU per run (other 0.10)"; categories at 0 left out. */
export function describeCpuPerRun(perRun: Record<CpuCategory | 'total', number>): string {
  const parts = CPU_CATEGORIES.filter((c) => c !== 'other' && perRun[c] > 0).map(
    (c) => `${c} ${perRun[c].toFixed(3)}`,
  );
  return `${parts.join(', ')} = ${perRun.total.toFixed(3)} ms CPU per run (everything else on the machine ${perRun.other.toFixed(3)})`;
}

/**
 * Where the machine's CPU went during a window: CPU seconds of the nodes, this process, the
 * PostgreSQL backends of the benchmark's database, the cluster's shared PostgreSQL processes
 * (WAL writer, checkpointer…), our Kafka broker and etcd, and everything else on the machine (other
 * people's tests share it), with the share of all cores.
 */
export class CpuMeter {
  private before = processes();
  private startedAt = performance.now();

  constructor(private readonly groups: CpuGroups) {}

  restart(): void {
    this.before = processes();
    this.startedAt = performance.now();
  }

  /** CPU seconds per group since construction or the last restart(). */
  async sample(cores: number): Promise<CpuSample> {
    const after = processes();
    const wallS = (performance.now() - this.startedAt) / 1000;
    const backends = new Set(await this.groups.backends().catch(() => []));
    const postmaster = Number(
      readFileSync(`${this.groups.repoRoot}.helios/pg/data/postmaster.pid`, 'utf8').split('\n')[0],
    );
    const totals: Record<string, number> = {};
    for (const [pid, now] of after) {
      const used = now.seconds - (this.before.get(pid)?.seconds ?? 0);
      if (used <= 0) continue;
      let group = this.groups.named.get(pid);
      if (!group && backends.has(pid)) group = 'postgres: bench database backends';
      else if (!group && now.ppid === postmaster && !cmdline(pid).includes('postgres: postgres '))
        group = 'postgres: shared (WAL, checkpoints)';
      else if (
        !group &&
        this.groups.brokers !== false &&
        now.comm === 'java' &&
        cmdline(pid).includes(`${this.groups.repoRoot}.helios/kafka/`)
      )
        group = 'kafka';
      else if (
        !group &&
        this.groups.brokers !== false &&
        now.comm === 'etcd' &&
        cmdline(pid).includes(`${this.groups.repoRoot}.helios/etcd/`)
      )
        group = 'etcd';
      group ??= 'other processes on the machine';
      totals[group] = (totals[group] ?? 0) + used;
    }
    return { wallS, cores, groups: totals };
  }

  async report(cores: number, runs?: number): Promise<string> {
    return formatCpu(await this.sample(cores), runs);
  }
}

/** A CPU sample as lines: per group, CPU seconds, share of a core and (given `runs`) ms per run. */
export function formatCpu(sample: CpuSample, runs?: number): string {
  const { wallS, cores } = sample;
  const entries = Object.entries(sample.groups).sort((a, b) => b[1] - a[1]);
  const total = entries.reduce((a, [, sec]) => a + sec, 0);
  const lines = entries.map(
    ([group, sec]) =>
      `  ${group.padEnd(36)} ${sec.toFixed(2).padStart(6)} s  ${((sec / wallS) * 100).toFixed(0).padStart(4)}% of a core` +
      (runs ? `  ${((sec * 1000) / runs).toFixed(3).padStart(6)} ms/run` : ''),
  );
  return [
    `CPU over ${wallS.toFixed(1)} s: ${total.toFixed(1)} CPU-s used of ${(wallS * cores).toFixed(1)} available (${((total / (wallS * cores)) * 100).toFixed(0)}%)`,
    ...lines,
    ...(runs ? [`  per run: ${describeCpuPerRun(cpuPerRun(sample, runs))}`] : []),
  ].join('\n');
}

/** Median per category over several runs' figures. */
export function medianCpuPerRun(
  runs: readonly Record<CpuCategory | 'total', number>[],
): Record<CpuCategory | 'total', number> {
  const middle = (values: number[]) =>
    values.sort((a, b) => a - b)[Math.floor((values.length - 1) / 2)] ?? NaN;
  return Object.fromEntries(
    [...CPU_CATEGORIES, 'total'].map((c) => [c, middle(runs.map((r) => r[c as CpuCategory]))]),
  ) as Record<CpuCategory | 'total', number>;
}
