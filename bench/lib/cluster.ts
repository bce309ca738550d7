import { mkdirSync, readFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Etcd3 } from 'etcd3';
import { createKafka, deleteTopics, describeGroup, type BrokerClient } from '../../src/broker/index.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { readLeader, type LeaderRecord } from '../../src/coordination/election.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createTestDatabase, type TestDatabase } from '../../test/support/database.js';
import { REPO_ROOT, serverEnv, uniqueId } from '../../test/support/env.js';
import { spawn } from 'node:child_process';
import {
  loggedAt,
  ManagedProcess,
  nodeEnvironment,
  stopAll,
  type NodeEnv,
} from '../../test/support/processes.js';
import type { CpuGroups } from './profile.js';
import { RecordingTarget } from './target.js';

/** Options of {@link startCluster}. */
export interface ClusterOptions {
  /** Nodes with every role; default 3. */
  readonly nodes?: number;
  /** Extra environment of every node (HELIOS_…). */
  readonly env?: Record<string, string>;
  /** Arguments for node itself, e.g. `--cpu-prof` (not allowed in NODE_OPTIONS). */
  readonly nodeArgs?: string[];
  /** Wait until every node's worker joined the consumer group; default true. */
  readonly waitForWorkers?: boolean;
}

/** Nodes a bench cluster starts unless told otherwise (the herd: 3 nodes on 2 cores). */
export const BENCH_NODES = 3;

/**
 * Helios nodes on the real local servers, isolated like a test: their own database (cloned from
 * the migrated template), etcd prefix and Kafka topics, plus a recording HTTP target. `stop()`
 * stops the nodes and removes all of it.
 */
export class BenchCluster {
  readonly nodes: ManagedProcess[] = [];
  readonly target = new RecordingTarget();
  readonly etcd: Etcd3;
  readonly kafka: BrokerClient;
  readonly nodeEnv: NodeEnv;
  private spawned = 0;

  private constructor(
    readonly db: TestDatabase,
    private readonly options: ClusterOptions,
  ) {
    const id = uniqueId();
    this.etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
    this.kafka = createKafka({
      brokers: serverEnv().kafkaBrokers.split(','),
      clientId: `bench-${id}`,
      logger: silentLogger,
    });
    this.nodeEnv = {
      databaseUrl: db.url,
      etcdPrefix: `/helios-bench/${id}`,
      topic: `helios.bench.${id}`,
      extra: {
        HELIOS_LOG_LEVEL: 'info',
        // Six partitions, as in production: with the test default (2) one of 3 workers gets none.
        HELIOS_KAFKA_PARTITIONS: '6',
        HELIOS_SHUTDOWN_TIMEOUT_MS: '5000',
        // The node flags the image ships, so the figures are those of a deployed node.
        NODE_OPTIONS: shippedNodeOptions(),
        ...options.env,
      },
    };
  }

  static async start(options: ClusterOptions = {}): Promise<BenchCluster> {
    const cluster = new BenchCluster(await createTestDatabase(), options);
    try {
      await cluster.target.start();
      for (let i = 0; i < (options.nodes ?? BENCH_NODES); i++) cluster.spawn();
      await cluster.ready(options.waitForWorkers ?? true);
      return cluster;
    } catch (err) {
      await cluster.stop();
      throw err;
    }
  }

  get leaderKey(): string {
    return `${this.nodeEnv.etcdPrefix}/leader`;
  }

  /** Starts one more node (all roles). */
  spawn(extra: Record<string, string> = {}): ManagedProcess {
    // As test/support's spawnNode (the built CLI), plus arguments for node itself.
    const name = `bench-${this.spawned++}`;
    const env = nodeEnvironment(name, { ...this.nodeEnv, extra: { ...this.nodeEnv.extra, ...extra } });
    const args = [...(this.options.nodeArgs ?? []), `${REPO_ROOT}dist/main.js`, 'node'];
    const node = new ManagedProcess(
      name,
      spawn(process.execPath, args, { env, stdio: ['ignore', 'pipe', 'pipe'] }),
    );
    this.nodes.push(node);
    return node;
  }

  get live(): ManagedProcess[] {
    return this.nodes.filter((n) => n.running);
  }

  /** The leader as etcd names it, once it is one of the live nodes. */
  async leader(timeoutMs = 20_000): Promise<{ record: LeaderRecord; node: ManagedProcess }> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const record = await readLeader(this.etcd, this.leaderKey);
      const node = record && this.live.find((n) => n.name === record.nodeId);
      if (record && node) return { record, node };
      if (Date.now() > deadline) throw new Error('no leader among the live nodes');
      await sleep(50);
    }
  }

  /** Nodes started, a leader elected, and (optionally) every worker a member of the group. */
  async ready(workers: boolean, timeoutMs = 60_000): Promise<void> {
    await Promise.all(this.live.map((n) => n.waitForLog((l) => l.msg === 'node started', timeoutMs)));
    await this.leader(timeoutMs);
    if (!workers) return;
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const group = await describeGroup(this.kafka, `${this.nodeEnv.topic}.workers`).catch(() => undefined);
      if (group?.state === 'Stable' && group.members.length === this.live.length) return;
      if (Date.now() > deadline) throw new Error(`consumer group not stable: ${group?.state}`);
      await sleep(200);
    }
  }

  /**
   * Inserts `count` jobs calling the target, with `schedule` and `next_run_at = firstAt`, in one
   * statement (the REST API is not what is measured). Names are `${prefix}-${n}`.
   */
  async insertJobs(count: number, schedule: string, firstAt: Date, prefix = 'bench'): Promise<void> {
    await this.db.pool.query(
      `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, next_run_at)
       SELECT $1 || '-' || n, $2, $3, 5000, 3, $4 FROM generate_series(1, $5) AS n`,
      [
        prefix,
        schedule,
        { url: `${this.target.url}/tick`, method: 'POST', body: { bench: true } },
        firstAt,
        count,
      ],
    );
  }

  /** A whole second at least `aheadMs` from now by the database clock. */
  async nextWholeSecond(aheadMs: number): Promise<Date> {
    const { rows } = await this.db.pool.query<{ at: Date }>(
      `SELECT date_trunc('second', now() + $1 * interval '1 millisecond') + interval '1 second' AS at`,
      [aheadMs],
    );
    return rows[0]!.at;
  }

  /**
   * What the nodes' logs say about the delivery path since `since` (ms since the epoch): consumer
   * group joins (each one a rebalance that pauses Kafka deliveries) and runs claimed by the
   * polling fallback (their Kafka message came too late).
   */
  deliveryEvents(since = 0): { joins: number; polled: number } {
    let joins = 0;
    let polled = 0;
    for (const node of this.nodes) {
      for (const line of node.logs) {
        const at = loggedAt(line);
        if (at < since) continue;
        if (line.msg === 'joined consumer group') joins++;
        if (line.msg === 'claimed overdue runs by polling') polled += Number(line.runs ?? 0);
      }
    }
    return { joins, polled };
  }

  /**
   * The nodes' log lines since `since` (ms since the epoch) that say something went wrong or who
   * leads: warnings and errors, and elections. Printed when a figure comes out far off, so that the
   * run says why.
   */
  incidents(since = 0): string[] {
    const lines: string[] = [];
    for (const node of this.nodes) {
      for (const line of node.logs) {
        const at = loggedAt(line);
        if (at < since) continue;
        const leadership = /leader|step|elect|epoch/i.test(String(line.msg));
        if (Number(line.level ?? 0) >= 40 || leadership) lines.push(`${node.name} ${JSON.stringify(line)}`);
      }
    }
    return lines;
  }

  /**
   * A Prometheus histogram of all live nodes, summed: count, mean, and the cumulative count per
   * bucket bound (seconds). Read from each node's /metrics (open: the bench sets no API tokens).
   */
  async histogram(name: string): Promise<{ count: number; mean: number; buckets: Map<number, number> }> {
    let count = 0;
    let sum = 0;
    const buckets = new Map<number, number>();
    for (const node of this.live) {
      const started = node.logs.find((l) => l.msg === 'node started');
      if (typeof started?.apiUrl !== 'string') continue;
      const text = await (await fetch(`${started.apiUrl}/metrics`)).text();
      for (const line of text.split('\n')) {
        const bucket = new RegExp(`^${name}_bucket\\{.*le="([^"]+)".*\\} (\\S+)$`).exec(line);
        if (bucket) buckets.set(Number(bucket[1]), (buckets.get(Number(bucket[1])) ?? 0) + Number(bucket[2]));
        if (line.startsWith(`${name}_sum`)) sum += Number(line.split(' ').at(-1));
        if (line.startsWith(`${name}_count`)) count += Number(line.split(' ').at(-1));
      }
    }
    return { count, mean: count ? sum / count : NaN, buckets };
  }

  /** Process groups of this cluster for {@link CpuMeter}. */
  cpuGroups(): CpuGroups {
    return {
      named: new Map([
        [process.pid, 'bench (target, sampling)'],
        ...this.nodes.map((n) => [n.pid, `node ${n.name}`] as const),
      ]),
      repoRoot: REPO_ROOT,
      backends: async () => {
        const { rows } = await this.db.pool.query<{ pid: number }>(
          'SELECT pid FROM pg_stat_activity WHERE datname = $1',
          [this.db.name],
        );
        return rows.map((r) => r.pid);
      },
    };
  }

  /** Stops the nodes, then drops the database, the etcd prefix and the topics. */
  async stop(): Promise<void> {
    const steps: [string, () => Promise<unknown>][] = [
      ['nodes', () => stopAll(this.nodes)],
      ['target', () => this.target.close()],
      ['database', () => this.db.drop()],
      ['etcd prefix', async () => this.etcd.delete().prefix(this.nodeEnv.etcdPrefix)],
      ['topics', () => deleteTopics(this.kafka, [this.nodeEnv.topic, `${this.nodeEnv.topic}.dlq`])],
    ];
    for (const [what, step] of steps) {
      await step().catch((err: unknown) => console.error(`bench cleanup: ${what} failed:`, err));
    }
    this.etcd.close();
  }
}

/** Cluster options under which every node can profile a window: SIGUSR2 starts, SIGUSR2 writes. */
export function profiled(dir: string): ClusterOptions {
  mkdirSync(dir, { recursive: true });
  return {
    nodeArgs: ['--import', `${REPO_ROOT}bench/lib/cpu-profiler.mjs`],
    env: { HELIOS_BENCH_PROFILE_DIR: dir },
  };
}

/** NODE_OPTIONS as the Dockerfile's runtime stage sets it ('' when it sets none). */
export function shippedNodeOptions(): string {
  return /^\s*NODE_OPTIONS=(\S+)/m.exec(readFileSync(`${REPO_ROOT}Dockerfile`, 'utf8'))?.[1] ?? '';
}
