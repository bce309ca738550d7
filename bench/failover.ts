/**
 * Failover benchmark: 3 scheduler nodes on the real servers, an every-second job; kill -9 of the
 * leader, then time until the new leader's first dispatch (first run row carrying its fencing
 * token). Repeats N times (default 10) and prints median and max.
 *
 *   npx tsx bench/failover.ts [tries]
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { createEtcdClient } from '../src/coordination/etcd.js';
import { readLeader } from '../src/coordination/election.js';
import { createTestDatabase } from '../test/support/database.js';
import { serverEnv, uniqueId } from '../test/support/env.js';
import { spawnNode, stopAll, type ManagedProcess } from '../test/support/processes.js';

const tries = Number(process.argv[2] ?? 10);
const db = await createTestDatabase();
const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
const env = {
  databaseUrl: db.url,
  etcdPrefix: `/helios-bench/${uniqueId()}`,
  topic: `helios.bench.${uniqueId()}`,
  extra: { HELIOS_ROLES: 'scheduler,api', HELIOS_LOG_LEVEL: 'warn' },
};
const nodes: ManagedProcess[] = [];
let next = 0;
const start = () => {
  const node = spawnNode(`fo-${next++}`, env);
  nodes.push(node);
  return node;
};

try {
  await db.pool.query(
    `INSERT INTO jobs (name, schedule, target, next_run_at)
     VALUES ('tick', '* * * * * *', '{"url":"http://127.0.0.1:9/"}', now())`,
  );
  const live = [start(), start(), start()];
  const results: number[] = [];
  for (let i = 0; i < tries; i++) {
    let leader = await readLeader(etcd, `${env.etcdPrefix}/leader`);
    while (!leader || !live.some((n) => n.name === leader!.nodeId)) {
      await sleep(50);
      leader = await readLeader(etcd, `${env.etcdPrefix}/leader`);
    }
    const victim = live.find((n) => n.name === leader!.nodeId)!;
    await sleep(1000 + Math.random() * 1000); // kill at a random point of the keep-alive cycle
    const killedAt = Date.now();
    victim.signal('SIGKILL');
    await victim.exited;
    live.splice(live.indexOf(victim), 1);
    let firstDispatch: number | null = null;
    while (firstDispatch === null) {
      const { rows } = await db.pool.query<{ at: Date | null }>(
        'SELECT min(created_at) AS at FROM runs WHERE created_epoch > $1',
        [leader.token.toString()],
      );
      if (rows[0]?.at) firstDispatch = rows[0].at.getTime();
      else await sleep(20);
    }
    results.push(firstDispatch - killedAt);
    console.log(`try ${i + 1}: kill -9 → first dispatch by the new leader ${firstDispatch - killedAt} ms`);
    live.push(start());
    await sleep(1500);
  }
  const sorted = [...results].sort((a, b) => a - b);
  const median = sorted[Math.floor(sorted.length / 2)]!;
  console.log(
    `\nfailover (kill -9 → first dispatch), ${tries} tries, TTL 3000 ms, ${(await import('node:os')).cpus().length} cores`,
  );
  console.log(`median ${median} ms   max ${sorted.at(-1)} ms   min ${sorted[0]} ms`);
} finally {
  await stopAll(nodes);
  await etcd.delete().prefix(env.etcdPrefix);
  etcd.close();
  await db.drop();
}
