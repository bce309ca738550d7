import type { Api, ApiOptions } from '../context.js';
import { COMMON_PROBLEMS, problems } from '../context.js';
import { countPendingOutbox } from '../../store/outbox.js';
import { countActiveRuns } from '../../store/run-history.js';
import { withTimeout } from '../../errors.js';
import { ProblemError } from '../problems.js';
import { Cluster } from '../schemas.js';

/** GET /cluster: who leads (etcd), which nodes are alive (etcd), and the queues (PostgreSQL). */
export function clusterRoutes(app: Api, options: ApiOptions): void {
  const { pool, cluster } = options;

  app.get(
    '/cluster',
    {
      schema: {
        tags: ['cluster'],
        summary: 'Leader, live nodes, pending outbox rows, queued and running runs',
        response: { 200: Cluster, ...problems(503, ...COMMON_PROBLEMS) },
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
      const [[leader, nodes], pending, runs] = await Promise.all([
        fromEtcd(),
        countPendingOutbox(pool),
        countActiveRuns(pool),
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
        outbox: { pending },
        runs,
      };
    },
  );
}
