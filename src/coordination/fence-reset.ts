import type { Database } from '../store/db.js';
import type { Etcd3 } from 'etcd3';
import { lowestLiveToken } from './ended-epochs.js';
import { readFence, setFence, type FenceRow } from '../store/fence.js';

/**
 * The operator's view of the leader fence against etcd, and the one way to lower it.
 *
 * Why this exists: the fencing token is the leader key's create_revision, and etcd revisions only
 * grow *within one etcd data set*. An etcd restored from a backup, or replaced by a fresh one,
 * starts again below the token PostgreSQL's leader_fence holds, so every future leader's first
 * write is rejected and the cluster dispatches nothing. Lowering the fence is safe only when no
 * leader of the old etcd can still write: it held a token up to the fence's, which would pass a
 * lowered fence. Nothing in Helios can prove that (a paused process of the old cluster may wake
 * up at any time), so the reset is an explicit operator step, not an automatic one.
 *
 * Why not automatic on the etcd cluster id: a restored cluster configured as before gets the
 * same cluster id (it is derived from the member names, peer URLs and cluster token), and a node
 * pointed at the wrong etcd by mistake would present a new id and take the fence from the real
 * cluster for good. Revision fencing fails safe in both cases (nothing is written); a cluster-id
 * generation would fail unsafe in the second and not at all detect the first.
 */

/** What `helios fence status` shows. */
export interface FenceStatus {
  readonly fence: FenceRow;
  /** etcd's current revision: every leader key created from now on has a larger create_revision. */
  readonly etcdRevision: bigint;
  /** Who holds the leader key now, if anyone. */
  readonly leader: { readonly nodeId: string; readonly token: bigint } | null;
  /** True when the fence is ahead of etcd: no leader elected now could write (etcd restored or replaced). */
  readonly fenceAhead: boolean;
}

export type FenceResetResult =
  | { readonly outcome: 'reset'; readonly from: bigint; readonly to: bigint }
  | { readonly outcome: 'not-needed'; readonly status: FenceStatus }
  | { readonly outcome: 'leader-present'; readonly status: FenceStatus }
  | { readonly outcome: 'changed-meanwhile'; readonly status: FenceStatus };

/** Reads the fence and, in one etcd request, the leader key and etcd's current revision. */
export async function fenceStatus(pool: Database, etcd: Etcd3, leaderKey: string): Promise<FenceStatus> {
  const [fence, live] = await Promise.all([readFence(pool), lowestLiveToken(etcd, leaderKey)]);
  // A held key's token is what its leader writes with; with no leader, the next one's token will
  // exceed the current revision.
  return { fence, etcdRevision: live.revision, leader: live.leader, fenceAhead: fence.token > live.token };
}

/**
 * Lowers the fence to etcd's current revision, so the next leader elected in this etcd can write
 * and every leader key created in it before the reset stays fenced out.
 *
 * Refuses while the leader key is held: a leader that holds it may be writing (its token passes
 * the fence only if the fence is not ahead, in which case nothing needs resetting), and the
 * operator's procedure is to stop every scheduler first. The UPDATE is conditional on the token
 * read, so a write that raced the check is not undone.
 */
export async function resetFence(pool: Database, etcd: Etcd3, leaderKey: string): Promise<FenceResetResult> {
  const status = await fenceStatus(pool, etcd, leaderKey);
  if (status.leader) return { outcome: 'leader-present', status };
  if (!status.fenceAhead) return { outcome: 'not-needed', status };
  const changed = await setFence(pool, status.etcdRevision, status.fence.token, 'helios fence reset');
  if (!changed) return { outcome: 'changed-meanwhile', status };
  return { outcome: 'reset', from: status.fence.token, to: status.etcdRevision };
}
