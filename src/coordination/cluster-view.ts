import type { Etcd3 } from 'etcd3';
import { readLeader, type LeaderRecord } from './election.js';
import { listNodes, type NodeInfo } from './registry.js';

/** What the cluster looks like in etcd: who leads and which nodes are registered. */
export interface ClusterView {
  leader(): Promise<LeaderRecord | null>;
  members(): Promise<NodeInfo[]>;
}

/** The cluster view of the nodes under `prefix` (HELIOS_ETCD_PREFIX), read from etcd on each call. */
export function clusterView(etcd: Etcd3, prefix: string): ClusterView {
  return {
    leader: () => readLeader(etcd, `${prefix}/leader`),
    members: () => listNodes(etcd, prefix),
  };
}
