import { importPeer, type HerdItem, type PeerQueue, type PeerSettings } from './peer.js';

// The part of pg-boss 12's API the benchmark uses (typed here so tsc needs no node_modules).
// Since 11: a named export, insert(name, jobs), stop() without `wait` (it always waits), and
// localConcurrency for N polling workers from one work() call.
interface Boss {
  on(event: 'error', listener: (err: unknown) => void): void;
  start(): Promise<unknown>;
  stop(options: { graceful: boolean; timeout: number }): Promise<void>;
  createQueue(name: string): Promise<void>;
  insert(name: string, jobs: { data: HerdItem; startAfter: string }[]): Promise<unknown>;
  work(
    name: string,
    options: { batchSize: number; pollingIntervalSeconds: number; localConcurrency: number },
    handler: (jobs: { data: HerdItem }[]) => Promise<void>,
  ): Promise<string>;
}
type BossClass = new (options: Record<string, unknown>) => Boss;

const QUEUE = 'herd';

async function open(url: string, options: Record<string, unknown> = {}): Promise<Boss> {
  const { PgBoss } = await importPeer<{ PgBoss: BossClass }>('pg-boss');
  // No maintenance or cron loops: they would only add load to the measured database.
  const boss = new PgBoss({ connectionString: url, supervise: false, schedule: false, ...options });
  boss.on('error', (err) => console.error('pg-boss:', err));
  await boss.start();
  return boss;
}

/**
 * pg-boss 12: batch fetch loops polling the job table. Its LISTEN/NOTIFY (`notify` queues, new in
 * 12) wakes workers when a job is created, not when a job created earlier becomes due, so it is
 * left off: the herd's items are inserted before they are due.
 */
export const pgBoss: PeerQueue = {
  name: 'pg-boss',
  describe: (s) =>
    `pg-boss 12.38.0: ${s.concurrency} workers per process (localConcurrency), batchSize ${s.batch}, ` +
    `pollingIntervalSeconds ${s.pollMs / 1000} (its minimum is 0.5), pool ${s.poolSize}; ` +
    `completions are batched per fetch by pg-boss`,
  async prepare(url) {
    const boss = await open(url);
    await boss.createQueue(QUEUE);
    await boss.stop({ graceful: false, timeout: 1000 });
  },
  async enqueue(url, count, at, offset = 0) {
    const boss = await open(url, { migrate: false });
    const startAfter = at.toISOString();
    await boss.insert(
      QUEUE,
      Array.from({ length: count }, (_, i) => ({ data: { n: offset + i }, startAfter })),
    );
    await boss.stop({ graceful: false, timeout: 1000 });
  },
  async work(url, settings: PeerSettings, handle) {
    const boss = await open(url, { migrate: false, max: settings.poolSize });
    await boss.work(
      QUEUE,
      {
        batchSize: settings.batch,
        pollingIntervalSeconds: settings.pollMs / 1000,
        localConcurrency: settings.concurrency,
      },
      // A batch handler: the batch's items run together (its calls share the process's
      // keep-alive pool; see herd-worker.ts), and the batch completes when all have.
      async (jobs) => {
        await Promise.all(jobs.map((job) => handle(job.data.n)));
      },
    );
    return () => boss.stop({ graceful: true, timeout: 5000 });
  },
};
