import { importPeer, type HerdItem, type PeerQueue, type PeerSettings } from './peer.js';

// The part of pg-boss 10's API the benchmark uses (typed here so tsc needs no node_modules).
interface Boss {
  on(event: 'error', listener: (err: unknown) => void): void;
  start(): Promise<unknown>;
  stop(options: { graceful: boolean; wait: boolean; timeout: number }): Promise<void>;
  createQueue(name: string): Promise<void>;
  insert(jobs: { name: string; data: HerdItem; startAfter: string }[]): Promise<unknown>;
  work(
    name: string,
    options: { batchSize: number; pollingIntervalSeconds: number },
    handler: (jobs: { data: HerdItem }[]) => Promise<void>,
  ): Promise<string>;
}
type BossClass = new (options: Record<string, unknown>) => Boss;

const QUEUE = 'herd';

async function open(url: string, options: Record<string, unknown> = {}): Promise<Boss> {
  const { default: PgBoss } = await importPeer<{ default: BossClass }>('pg-boss');
  // No maintenance or cron loops: they would only add load to the measured database.
  const boss = new PgBoss({ connectionString: url, supervise: false, schedule: false, ...options });
  boss.on('error', (err) => console.error('pg-boss:', err));
  await boss.start();
  return boss;
}

/** pg-boss 10 (the newest major that runs on Node 20): batch fetch loops polling the job table. */
export const pgBoss: PeerQueue = {
  name: 'pg-boss',
  describe: (s) =>
    `pg-boss 10.4.2: ${s.concurrency} work() loops per process, batchSize ${s.batch}, ` +
    `pollingIntervalSeconds ${s.pollMs / 1000} (its minimum is 0.5), pool ${s.poolSize}; ` +
    `completions are batched per fetch by pg-boss`,
  async prepare(url) {
    const boss = await open(url);
    await boss.createQueue(QUEUE);
    await boss.stop({ graceful: false, wait: true, timeout: 1000 });
  },
  async enqueue(url, count, at) {
    const boss = await open(url, { migrate: false });
    const startAfter = at.toISOString();
    await boss.insert(Array.from({ length: count }, (_, n) => ({ name: QUEUE, data: { n }, startAfter })));
    await boss.stop({ graceful: false, wait: true, timeout: 1000 });
  },
  async work(url, settings: PeerSettings, started) {
    const boss = await open(url, { migrate: false, max: settings.poolSize });
    for (let i = 0; i < settings.concurrency; i++) {
      await boss.work(
        QUEUE,
        { batchSize: settings.batch, pollingIntervalSeconds: settings.pollMs / 1000 },
        async (jobs) => {
          for (const job of jobs) started(job.data.n);
        },
      );
    }
    return () => boss.stop({ graceful: true, wait: true, timeout: 5000 });
  },
};
