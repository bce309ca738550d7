/**
 * Failover benchmark: 3 scheduler nodes on the real servers, an every-second job; kill -9 of the
 * leader, then time until the new leader's first dispatch (first run row carrying its fencing
 * token). Repeats N times (default 10) and prints median and max, and how much of it passed before
 * the old leader's key was deleted (its lease expired and revoked: the TTL's share) and after it
 * (the successor's campaign, takeover and first dispatch transaction).
 *
 *   npm run build && npx tsx bench/failover.ts [tries]
 */
import { cpus } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { BenchCluster } from './lib/cluster.js';
import { max, median } from './lib/stats.js';

export interface FailoverResult {
  readonly tries: number[];
  readonly median: number;
  readonly max: number;
  /** Kill -9 → the leader key deleted, per try. */
  readonly keyDeleted: number[];
  readonly ttlMs: number;
}

export async function failover(tries: number, log?: (line: string) => void): Promise<FailoverResult> {
  const cluster = await BenchCluster.start({
    env: { HELIOS_ROLES: 'scheduler,api' },
    waitForWorkers: false,
  });
  try {
    await cluster.db.pool.query(
      `INSERT INTO jobs (name, schedule, target, next_run_at)
       VALUES ('tick', '* * * * * *', '{"url":"http://127.0.0.1:9/"}', now())`,
    );
    const results: number[] = [];
    const keyDeleted: number[] = [];
    let deletedAt = 0;
    const watcher = await cluster.etcd.watch().key(cluster.leaderKey).create();
    watcher.on('delete', () => void (deletedAt = Date.now()));
    for (let i = 0; i < tries; i++) {
      const { record: leader, node: victim } = await cluster.leader();
      await sleep(1000 + Math.random() * 1000); // kill at a random point of the keep-alive cycle
      const killedAt = Date.now();
      victim.signal('SIGKILL');
      await victim.exited;
      let firstDispatch: number | null = null;
      while (firstDispatch === null) {
        const { rows } = await cluster.db.pool.query<{ at: Date | null }>(
          'SELECT min(created_at) AS at FROM runs WHERE created_epoch > $1',
          [leader.token.toString()],
        );
        if (rows[0]?.at) firstDispatch = rows[0].at.getTime();
        else await sleep(20);
      }
      results.push(firstDispatch - killedAt);
      keyDeleted.push(deletedAt - killedAt);
      log?.(
        `try ${i + 1}: kill -9 → first dispatch by the new leader ${firstDispatch - killedAt} ms ` +
          `(key deleted after ${deletedAt - killedAt} ms, then ${firstDispatch - deletedAt} ms)`,
      );
      cluster.spawn();
      await sleep(1500);
    }
    await watcher.cancel();
    return { tries: results, median: median(results), max: max(results), keyDeleted, ttlMs: 3000 };
  } finally {
    await cluster.stop();
  }
}

async function main(): Promise<void> {
  const tries = Number(process.argv[2] ?? 10);
  const result = await failover(tries, (line) => console.log(line));
  console.log(
    `\nfailover (kill -9 → first dispatch), ${tries} tries, TTL ${result.ttlMs} ms, ${cpus().length} cores`,
  );
  console.log(`median ${result.median} ms   max ${result.max} ms   min ${Math.min(...result.tries)} ms`);
  const after = result.tries.map((t, i) => t - result.keyDeleted[i]!);
  console.log(
    `key deleted: median ${median(result.keyDeleted)} ms, max ${max(result.keyDeleted)} ms; ` +
      `then to the first dispatch: median ${median(after)} ms, max ${max(after)} ms`,
  );
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
