import { setTimeout as sleep } from 'node:timers/promises';
import type pg from 'pg';
import { infra, type ManagedProcess } from '../support/processes.js';
import type { ChaosCluster, Server } from './cluster.js';
import type { Direction } from './netns.js';
import { shuffle } from './random.js';

/** Node partitions: `partition-<what>-<direction>`, by packet filtering in the node's namespace. */
const PARTITIONS = [
  'partition-etcd-both',
  'partition-etcd-in',
  'partition-etcd-out',
  'partition-postgres-both',
  'partition-postgres-in',
  'partition-postgres-out',
  'partition-postgres-leader',
  'partition-kafka-both',
  'partition-kafka-in',
  'partition-kafka-out',
  'partition-all-both',
  'partition-all-in',
  'partition-all-out',
] as const;

/** Short faults: each recovers within seconds. */
export const FAULT_KINDS = [
  'kill-leader',
  'pause-leader',
  'kill-worker-mid-call',
  'sigterm-leader',
  'sigterm-worker-mid-call',
  'restart-kafka',
  'restart-postgres',
  'restart-etcd',
  'kill-etcd-leader',
  'isolate-etcd-leader',
  'isolate-etcd-follower',
  ...PARTITIONS,
] as const;

/** Long outages, only in long runs (they need minutes of the fault phase). */
export const LONG_FAULT_KINDS = ['postgres-down-30s', 'kafka-down-120s', 'etcd-down-30s'] as const;

export type FaultKind = (typeof FAULT_KINDS)[number] | (typeof LONG_FAULT_KINDS)[number];

/** Runs at least this long get every fault kind, the long outages included. */
export const LONG_RUN_MS = 600_000;

/**
 * Faults during which a worker may have reached the target but not recorded it (it died, froze,
 * or lost PostgreSQL), so the run is delivered again: the checker accepts repeats only near one.
 */
export const FAULTS_EXPLAINING_REDELIVERY: readonly FaultKind[] = [
  'kill-leader',
  'kill-worker-mid-call',
  'pause-leader',
  'restart-postgres',
  'postgres-down-30s',
  'partition-postgres-both',
  'partition-postgres-in',
  'partition-postgres-out',
  'partition-postgres-leader',
  'partition-all-both',
  'partition-all-in',
  'partition-all-out',
];

/** Kinds that need network namespaces (the TCP proxy fallback has only the etcd cut). */
const NEEDS_NETNS = new Set<FaultKind>([
  ...PARTITIONS.filter((k) => k !== 'partition-etcd-both'),
  'isolate-etcd-leader',
  'isolate-etcd-follower',
]);

/**
 * The kinds that must each happen once, in a seeded order. A long run (`LONG_RUN_MS`) gets every
 * kind; a short one (the CI run) the process and server faults, one etcd-cluster fault, the
 * leader's symmetric etcd partition, the leader cut from PostgreSQL (with namespaces) and one more
 * seeded partition, to stay near 100 s. The run adds
 * random kinds from `available` while its fault phase lasts. `CHAOS_FAULTS` (a comma list)
 * replaces the required kinds.
 */
export function planFaults(
  durationMs: number,
  netns: boolean,
  random: () => number,
): { required: FaultKind[]; available: FaultKind[] } {
  const available = FAULT_KINDS.filter((k) => netns || !NEEDS_NETNS.has(k));
  // CHAOS_FAULTS=kind,kind…: exactly these first (to reproduce or study a few kinds).
  const only = process.env.CHAOS_FAULTS?.split(',').filter(Boolean);
  if (only?.length) {
    const known: readonly string[] = [...available, ...LONG_FAULT_KINDS];
    const unknown = only.filter((k) => !known.includes(k));
    if (unknown.length) throw new Error(`CHAOS_FAULTS: unknown or unavailable kinds ${unknown.join(' ')}`);
    return { required: only as FaultKind[], available };
  }
  if (durationMs >= LONG_RUN_MS) {
    return { required: shuffle([...available, ...LONG_FAULT_KINDS], random), available };
  }
  const pick = <T>(from: T[]) => from[Math.floor(random() * from.length)]!;
  const required: FaultKind[] = [
    'kill-leader',
    'pause-leader',
    'kill-worker-mid-call',
    'sigterm-worker-mid-call',
    'restart-kafka',
    'restart-postgres',
    'restart-etcd',
    'partition-etcd-both',
    pick(available.filter((k) => k === 'kill-etcd-leader' || k.startsWith('isolate-etcd-'))),
  ];
  if (available.includes('partition-postgres-leader')) required.push('partition-postgres-leader');
  const more = available.filter((k) => k.startsWith('partition-') && !required.includes(k));
  if (more.length > 0) required.push(pick(more));
  return { required: shuffle(required, random), available };
}

/** What the checker needs to know about one injected fault. */
export interface FaultRecord {
  readonly kind: FaultKind;
  /** The node (or etcd member) the fault hit, if it hit one. */
  readonly node?: string;
  /** Wall-clock ms: when the fault began and when recovery was complete. */
  readonly start: number;
  end: number;
  /** For kill and pause: the instant the node stopped acting (its beliefs end here). */
  readonly haltedAt?: number;
  /** For pause-leader: whether a leader write was held at the moment of the pause. */
  heldWrite?: boolean;
  note?: string;
}

export interface FaultContext {
  readonly cluster: ChaosCluster;
  readonly pool: pg.Pool;
  readonly ttlMs: number;
  readonly log: (message: string) => void;
}

/** Injects one fault and recovers from it; resolves when the recovery step is done. */
export async function injectFault(kind: FaultKind, ctx: FaultContext): Promise<FaultRecord> {
  switch (kind) {
    case 'kill-leader':
      return killNode(kind, await ctx.cluster.leader(), ctx);
    case 'kill-worker-mid-call': {
      const [victim, note] = await workerMidCall(ctx);
      return killNode(kind, victim, ctx, note);
    }
    case 'sigterm-leader':
      return stopNode(kind, await ctx.cluster.leader(), ctx);
    case 'sigterm-worker-mid-call': {
      const [victim, note] = await workerMidCall(ctx);
      return stopNode(kind, victim, ctx, note);
    }
    case 'pause-leader':
      return pauseLeader(ctx);
    case 'restart-kafka':
      return restartServer(kind, 'kafka', 2000, ctx);
    case 'restart-postgres':
      return restartServer(kind, 'pg', 1000, ctx);
    case 'restart-etcd':
      return restartEtcd(kind, 1000, ctx);
    case 'kill-etcd-leader':
      return killEtcdLeader(ctx);
    case 'isolate-etcd-leader':
    case 'isolate-etcd-follower':
      return isolateEtcdMember(kind, ctx);
    case 'postgres-down-30s':
      return restartServer(kind, 'pg', 30_000, ctx);
    case 'kafka-down-120s':
      return restartServer(kind, 'kafka', 120_000, ctx);
    case 'etcd-down-30s':
      return restartEtcd(kind, 30_000, ctx);
    default:
      return partition(kind, ctx);
  }
}

async function killNode(
  kind: FaultKind,
  node: ManagedProcess,
  ctx: FaultContext,
  note?: string,
): Promise<FaultRecord> {
  const start = Date.now();
  node.signal('SIGKILL');
  await node.exited;
  const record: FaultRecord = { kind, node: node.name, start, end: start, haltedAt: start, note };
  await sleep(1000);
  await ctx.cluster.spawn(node.name);
  record.end = Date.now();
  return record;
}

/**
 * One step of a rolling restart: SIGTERM, the node drains and exits by itself, and is started again
 * a second later. Its exit counts as caused by the fault (`haltedAt`) only if it exited 0; any other
 * exit is left for the checker to report as a node that exited on its own. A graceful stop may
 * cut only a call that was in flight when it began (the checker's `explainingFault`).
 */
async function stopNode(
  kind: FaultKind,
  node: ManagedProcess,
  ctx: FaultContext,
  note?: string,
): Promise<FaultRecord> {
  const start = Date.now();
  node.signal('SIGTERM');
  const { code, signal } = await node.exited;
  const exitedAt = Date.now();
  const exit = code === 0 ? undefined : `exited with ${code ?? signal} after SIGTERM`;
  const record: FaultRecord = {
    kind,
    node: node.name,
    start,
    end: exitedAt,
    haltedAt: exit ? undefined : exitedAt,
    note: [note, exit, `stopped in ${exitedAt - start} ms`].filter(Boolean).join('; '),
  };
  ctx.log(`  ${node.name} stopped in ${exitedAt - start} ms${exit ? ` (${exit})` : ''}`);
  await sleep(1000);
  await ctx.cluster.spawn(node.name);
  record.end = Date.now();
  return record;
}

/** A node other than the leader with a claimed run in flight (or any follower after 5 s). */
async function workerMidCall(ctx: FaultContext): Promise<[ManagedProcess, string?]> {
  const leader = await ctx.cluster.leader();
  const deadline = Date.now() + 5000;
  while (Date.now() < deadline) {
    const { rows } = await ctx.pool.query<{ claimed_by: string }>(
      `SELECT DISTINCT claimed_by FROM runs WHERE state = 'running' AND claimed_by <> $1`,
      [leader.name],
    );
    const victim = rows.map((r) => ctx.cluster.live.get(r.claimed_by)).find((n) => n?.running);
    if (victim) return [victim];
    await sleep(20);
  }
  const fallback = [...ctx.cluster.live.values()].find((n) => n !== leader && n.running)!;
  return [fallback, 'no call was in flight on a follower; took one anyway'];
}

/**
 * SIGSTOP of the leader for 2×TTL, at the worst moment: a leader write that already passed its
 * leadership check is held (IPC gate) when the process is frozen, and released after SIGCONT,
 * so the fence must reject it.
 */
async function pauseLeader(ctx: FaultContext): Promise<FaultRecord> {
  const leader = await ctx.cluster.leader();
  const heldWrite = await ctx.cluster.holdNextWrite(leader, 3000);
  const start = Date.now();
  leader.signal('SIGSTOP');
  const record: FaultRecord = {
    kind: 'pause-leader',
    node: leader.name,
    start,
    end: start,
    haltedAt: start,
    heldWrite,
  };
  await sleep(2 * ctx.ttlMs);
  leader.signal('SIGCONT');
  ctx.cluster.releaseWrite(leader);
  record.end = Date.now();
  return record;
}

const DIRECTIONS: Record<string, Direction> = {
  both: 'both',
  in: 'inbound',
  out: 'outbound',
  leader: 'both',
};

/**
 * `partition-<what>-<direction>`: one node loses etcd, PostgreSQL, Kafka or everything, in one
 * direction or both (packets silently dropped), for 2×TTL (3×TTL for PostgreSQL, so a claim held
 * across the cut can expire). The victim is the leader, except for PostgreSQL: a worker with a
 * call in flight, whose completion cannot be recorded. `partition-postgres-leader` cuts the
 * leader from PostgreSQL both ways: etcd still renews its lease, so it must hand over by itself
 * (README, "A leader that cannot reach PostgreSQL hands over"). Without namespaces only
 * `partition-etcd-both` exists, through the node's TCP proxies.
 */
async function partition(kind: FaultKind, ctx: FaultContext): Promise<FaultRecord> {
  const [, what, dir] = kind.split('-') as [string, Server | 'all', string];
  const direction = DIRECTIONS[dir]!;
  const [victim, note] =
    what === 'postgres' && dir !== 'leader' ? await workerMidCall(ctx) : [await ctx.cluster.leader()];
  const network = ctx.cluster.network;
  const start = Date.now();
  if (network) {
    await network.cut(victim.name, what === 'all' ? 'all' : ctx.cluster.peers(what), direction);
  } else {
    for (const proxy of ctx.cluster.proxies.get(victim.name)!) proxy.cut();
  }
  const record: FaultRecord = {
    kind,
    node: victim.name,
    start,
    end: start,
    note: network ? note : `through the TCP proxies: no network namespaces${note ? `; ${note}` : ''}`,
  };
  await sleep((what === 'postgres' ? 3 : 2) * ctx.ttlMs);
  if (network) await network.heal(victim.name);
  else for (const proxy of ctx.cluster.proxies.get(victim.name)!) proxy.heal();
  record.end = Date.now();
  return record;
}

/** kill -9 of the etcd member that is raft leader; restarted on its data after 2 s. */
async function killEtcdLeader(ctx: FaultContext): Promise<FaultRecord> {
  const etcd = ctx.cluster.etcdCluster;
  const member = await etcd.leader();
  const start = Date.now();
  await etcd.stopMember(member, 'SIGKILL');
  const record: FaultRecord = { kind: 'kill-etcd-leader', node: member.name, start, end: start };
  await sleep(2000);
  etcd.startMember(member);
  await etcd.waitHealthy(30_000);
  const next = await etcd.leader();
  record.note = `new etcd leader ${next.name}`;
  record.end = Date.now();
  return record;
}

/**
 * One etcd member, the raft leader or a follower, loses the other members and every client (all
 * its packets dropped) for 8 s; the other two keep a quorum.
 */
async function isolateEtcdMember(kind: FaultKind, ctx: FaultContext): Promise<FaultRecord> {
  const etcd = ctx.cluster.etcdCluster;
  const leader = await etcd.leader();
  const member = kind === 'isolate-etcd-leader' ? leader : etcd.members.find((m) => m !== leader)!;
  const start = Date.now();
  await ctx.cluster.network!.cut(member.name, 'all', 'both');
  const record: FaultRecord = { kind, node: member.name, start, end: start };
  await sleep(8000);
  await ctx.cluster.network!.heal(member.name);
  await etcd.waitHealthy(30_000);
  record.end = Date.now();
  return record;
}

/** Every etcd member stopped (SIGTERM) for `downMs`, then restarted on its data. */
async function restartEtcd(kind: FaultKind, downMs: number, ctx: FaultContext): Promise<FaultRecord> {
  const etcd = ctx.cluster.etcdCluster;
  const start = Date.now();
  await etcd.stop();
  await sleep(downMs);
  for (const m of etcd.members) etcd.startMember(m);
  await etcd.waitHealthy(30_000);
  const record: FaultRecord = { kind, start, end: Date.now() };
  if (downMs >= 10_000) await waitForCatchUp(record, ctx);
  return record;
}

async function restartServer(
  kind: FaultKind,
  server: string,
  downMs: number,
  ctx: FaultContext,
): Promise<FaultRecord> {
  const start = Date.now();
  await infra('down', server);
  await sleep(downMs);
  await infra('up', server);
  const record: FaultRecord = { kind, start, end: Date.now() };
  if (downMs >= 10_000) await waitForCatchUp(record, ctx);
  return record;
}

/**
 * After a long outage: waits (up to 3 min) until the dispatcher has caught up with every job and
 * no run is overdue in the queue, so the next fault does not hit a cluster still recovering; the
 * fault's recovery time includes this.
 */
async function waitForCatchUp(record: FaultRecord, ctx: FaultContext): Promise<void> {
  const deadline = Date.now() + 180_000;
  for (;;) {
    // Jobs whose next occurrence is over 3 s late, and queued runs over 5 s overdue.
    const behind = await ctx.pool
      .query<{ jobs: number; runs: number }>(
        `SELECT (SELECT count(*)::int FROM jobs WHERE enabled AND next_run_at < now() - interval '3 seconds') AS jobs,
                (SELECT count(*)::int FROM runs WHERE state = 'queued' AND not_before < now() - interval '5 seconds') AS runs`,
      )
      .then((r) => r.rows[0]!)
      .catch(() => ({ jobs: -1, runs: -1 }));
    if (behind.jobs === 0 && behind.runs === 0) break;
    if (Date.now() > deadline) {
      record.note = `not caught up 3 min after the outage (${behind.jobs} jobs, ${behind.runs} runs behind)`;
      ctx.log(`  ${record.note}`);
      break;
    }
    await sleep(500);
  }
  ctx.log(`  caught up ${Math.round((Date.now() - record.end) / 1000)} s after the outage ended`);
  record.end = Date.now();
}
