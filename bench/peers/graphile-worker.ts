import { importPeer, type HerdItem, type PeerQueue } from './peer.js';

// The part of graphile-worker 0.18's API the benchmark uses (typed here so tsc needs no node_modules).
interface Runner {
  stop(): Promise<void>;
}
interface WorkerUtils {
  addJobs(specs: { identifier: string; payload: HerdItem; runAt: Date }[]): Promise<unknown>;
  release(): Promise<void>;
}
interface GraphileWorker {
  run(options: Record<string, unknown>): Promise<Runner>;
  runMigrations(options: Record<string, unknown>): Promise<void>;
  makeWorkerUtils(options: Record<string, unknown>): Promise<WorkerUtils>;
  Logger: new (factory: () => (level: string, message: string) => void) => unknown;
}

const TASK = 'herd';
const load = () => importPeer<GraphileWorker>('graphile-worker');

/** graphile-worker's Logger with only warnings and errors (its info lines would flood the output). */
async function silent(): Promise<unknown> {
  const { Logger } = await load();
  return new Logger(() => (level: string, message: string) => {
    if (level === 'error' || level === 'warning') console.error(`graphile-worker ${level}: ${message}`);
  });
}

/**
 * graphile-worker 0.18 (pure ESM since 0.18; run, runMigrations, makeWorkerUtils and Logger are
 * unchanged): a worker pool with a local queue (one
 * query locks a batch), batched completions, polling for jobs that become due (its LISTEN wakes it
 * only for jobs inserted already due).
 */
export const graphileWorker: PeerQueue = {
  name: 'graphile-worker',
  describe: (s) =>
    `graphile-worker 0.18.0: concurrency ${s.concurrency} per process, localQueue.size ${s.batch}, ` +
    `pollInterval ${s.pollMs} ms, completeJobBatchDelay 0, pool ${s.poolSize}`,
  async prepare(url) {
    const worker = await load();
    await worker.runMigrations({ connectionString: url, logger: await silent() });
  },
  async enqueue(url, count, at, offset = 0) {
    const worker = await load();
    const utils = await worker.makeWorkerUtils({ connectionString: url, logger: await silent() });
    try {
      await utils.addJobs(
        Array.from({ length: count }, (_, i) => ({
          identifier: TASK,
          payload: { n: offset + i },
          runAt: at,
        })),
      );
    } finally {
      await utils.release();
    }
  },
  async work(url, settings, handle) {
    const worker = await load();
    const runner = await worker.run({
      connectionString: url,
      concurrency: settings.concurrency,
      maxPoolSize: settings.poolSize,
      pollInterval: settings.pollMs,
      noHandleSignals: true,
      logger: await silent(),
      taskList: {
        [TASK]: async (payload: unknown) => {
          await handle((payload as HerdItem).n);
        },
      },
      preset: { worker: { localQueue: { size: settings.batch }, completeJobBatchDelay: 0 } },
    });
    return () => runner.stop();
  },
};
