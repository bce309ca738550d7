import type { Etcd3 } from 'etcd3';
import type { EndedEpochsReading } from '../store/runs.js';
import { leaderKeyOf } from './election.js';

/**
 * The token below which every leader epoch has ended, from one read of the leader key: the key's
 * create_revision (its epoch's token) while a leader holds it, else etcd's revision + 1 (a key
 * created later gets a greater create_revision).
 */
export async function lowestLiveToken(
  etcd: Etcd3,
  leaderKey: string,
): Promise<{
  token: bigint;
  leader: { nodeId: string; token: bigint } | null;
  revision: bigint;
  /** Which cluster and key the token is of (leaderKeyOf). */
  leaderKey: string;
}> {
  const response = await etcd.get(leaderKey).exec();
  const kv = response.kvs[0];
  const revision = BigInt(response.header.revision);
  const leader = kv
    ? {
        nodeId: (JSON.parse(kv.value.toString()) as { nodeId?: string }).nodeId ?? '(unknown)',
        token: BigInt(kv.create_revision),
      }
    : null;
  return {
    token: leader ? leader.token : revision + 1n,
    leader,
    revision,
    leaderKey: leaderKeyOf(response.header.cluster_id, leaderKey),
  };
}

/**
 * Which leader epochs have ended, as etcd says (EndedEpochsReading). The
 * workers' misfire rule (misfiredAtClaim in store/runs.ts) reads it beside the fence, which learns
 * of a new epoch only at that epoch's first write: a worker back after the whole cluster was
 * down, before any leader has written, learns here that the leader of the runs it finds late is
 * gone, and drops them as their jobs' misfire policies say instead of running them late.
 *
 * A reading stays true while etcd keeps its data (an epoch that ended never resumes), so an old
 * one would only know of fewer ended epochs; but an etcd restored from a backup or replaced starts
 * its revisions again lower (fence-reset.ts), and there an old reading would call the new epochs
 * ended. So a reading counts for `maxAgeMs` only (less than the misfire threshold: a run of an
 * epoch begun after the swap is not yet late while a reading from before it counts). Null when
 * no reading is that recent: the fence alone decides, as before.
 */
export class EndedEpochs {
  private last: (EndedEpochsReading & { at: number }) | undefined;

  constructor(
    private readonly etcd: Etcd3,
    private readonly leaderKey: string,
    private readonly maxAgeMs: number,
  ) {}

  /** The latest reading if recent enough; null: none is. */
  reading(): EndedEpochsReading | null {
    if (!this.last || performance.now() - this.last.at > this.maxAgeMs) return null;
    return { below: this.last.below, leaderKey: this.last.leaderKey };
  }

  /** Reads the leader key again; errors propagate (the last reading stays until it is too old). */
  async read(): Promise<void> {
    const at = performance.now();
    const { token, leaderKey } = await lowestLiveToken(this.etcd, this.leaderKey);
    this.last = { below: token, leaderKey, at };
  }
}
