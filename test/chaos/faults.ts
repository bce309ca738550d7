import { setTimeout as sleep } from 'node:timers/promises';
import type pg from 'pg';
import { infra, type ManagedProcess } from '../support/processes.js';
import type { ChaosCluster } from './cluster.js';

export const FAULT_KINDS = [
  'kill-leader',
  'pause-leader',
  'kill-worker-mid-call',
  'restart-kafka',
  'restart-postgres',
  'restart-etcd',
  'cut-leader-from-etcd',
] as const;
export type FaultKind = (typeof FAULT_KINDS)[number];

/** What the checker needs to know about one injected fault. */
export interface FaultRecord {
  readonly kind: FaultKind;
  /** The node the fault hit, if it hit one. */
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
    case 'kill-worker-mid-call':
      return killWorkerMidCall(ctx);
    case 'pause-leader':
      return pauseLeader(ctx);
    case 'cut-leader-from-etcd':
      return cutLeaderFromEtcd(ctx);
    case 'restart-kafka':
      return restartServer(kind, 'kafka', 2000);
    case 'restart-postgres':
      return restartServer(kind, 'pg', 1000);
    case 'restart-etcd':
      return restartServer(kind, 'etcd', 1000);
  }
}

async function killNode(kind: FaultKind, node: ManagedProcess, ctx: FaultContext): Promise<FaultRecord> {
  const start = Date.now();
  node.signal('SIGKILL');
  await node.exited;
  const record: FaultRecord = { kind, node: node.name, start, end: start, haltedAt: start };
  await sleep(1000);
  await ctx.cluster.spawn(node.name);
  record.end = Date.now();
  return record;
}

/** Kills a node that is not the leader while it has a claimed run in flight. */
async function killWorkerMidCall(ctx: FaultContext): Promise<FaultRecord> {
  const leader = await ctx.cluster.leader();
  const deadline = Date.now() + 5000;
  while (Date.now() < deadline) {
    const { rows } = await ctx.pool.query<{ claimed_by: string }>(
      `SELECT DISTINCT claimed_by FROM runs WHERE state = 'running' AND claimed_by <> $1`,
      [leader.name],
    );
    const victim = rows.map((r) => ctx.cluster.live.get(r.claimed_by)).find((n) => n?.running);
    if (victim) return killNode('kill-worker-mid-call', victim, ctx);
    await sleep(20);
  }
  const fallback = [...ctx.cluster.live.values()].find((n) => n !== leader && n.running)!;
  const record = await killNode('kill-worker-mid-call', fallback, ctx);
  record.note = 'no call was in flight on a follower; killed one anyway';
  return record;
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

/** The leader loses etcd (traffic silently dropped) but keeps PostgreSQL, for 2×TTL. */
async function cutLeaderFromEtcd(ctx: FaultContext): Promise<FaultRecord> {
  const leader = await ctx.cluster.leader();
  const proxy = ctx.cluster.proxies.get(leader.name)!;
  const start = Date.now();
  proxy.cut();
  const record: FaultRecord = { kind: 'cut-leader-from-etcd', node: leader.name, start, end: start };
  await sleep(2 * ctx.ttlMs);
  proxy.heal();
  record.end = Date.now();
  return record;
}

async function restartServer(kind: FaultKind, server: string, downMs: number): Promise<FaultRecord> {
  const start = Date.now();
  await infra('down', server);
  await sleep(downMs);
  await infra('up', server);
  return { kind, start, end: Date.now() };
}
