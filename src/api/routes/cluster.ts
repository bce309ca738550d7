import type { Api, ApiOptions } from '../context.js';
import { COMMON_PROBLEMS, problems } from '../context.js';
import { CLUSTER_COUNT_CAP } from '../../observability/cluster-signals.js';
import { readClusterCounts } from '../../store/signals.js';
import { withTimeout } from '../../errors.js';
import { ProblemError } from '../problems.js';
import { Cluster } from '../schemas.js';

/**
 * GET /cluster: who leads (etcd), which nodes are alive (etcd), and the queues (PostgreSQL): the
 * figures the leader's cluster gauges export, read now by whichever node answers.
 */
export function clusterRoutes(app: Api, options: ApiOptions): void {
  const { pool, cluster } = options;
  const overdueMs = options.misfireThresholdMs ?? 5000;

  app.get(
    '/cluster',
    {
      schema: {
        tags: ['cluster'],
        summary:
          'Leader, live nodes, pending outbox rows, queued, overdue, waiting and running runs, open dead letters',
        response: { 200: Cluster, ...problems(...COMMON_PROBLEMS) },
      },
    },
    async () => {
      const fromEtcd = async () => {
        try {
          return await withTimeout(
            Promise.all([cluster.leader(), cluster.members()]),
            3000,
            'etcd cluster view',
          );
        } catch {
          throw new ProblemError(503, 'unavailable', 'Service unavailable', 'etcd did not answer');
        }
      };
      // The gauges' statement: each count stops at the cap, so a backlog of millions costs a call
      // what one of the cap costs.
      const [[leader, nodes], counts] = await Promise.all([
        fromEtcd(),
        readClusterCounts(pool, overdueMs, CLUSTER_COUNT_CAP),
      ]);
      return {
        leader: leader && {
          nodeId: leader.nodeId,
          fencingToken: Number(leader.token),
          since: leader.since,
        },
        nodes: nodes.map((n) => ({
          id: n.id,
          host: n.host,
          pid: n.pid,
          apiUrl: n.apiUrl,
          roles: [...n.roles],
          lastSeen: n.lastSeen,
        })),
        outbox: { pending: counts.outboxPending, oldestDueAgeSeconds: counts.outboxOldestAgeSeconds },
        runs: {
          queued: counts.runsQueued,
          overdue: counts.runsOverdue,
          waitingForbid: counts.runsWaitingForbid,
          running: counts.runsRunning,
        },
        deadLetters: { open: counts.deadLettersOpen },
      };
    },
  );
}
