/**
 * Churn: does a node's own memory and resources level off while users churn jobs for months?
 * 3 nodes on the real local servers (as every benchmark: loopback only) while, continuously and
 * through the REST API of every node in turn, jobs with unique names (half of them with a schedule
 * of their own) are created and deleted (thousands over the run), paused and resumed, PATCHed (schedule, target, headers) and
 * triggered; jobs that fail at once (a refused port, one attempt) bury runs whose dead letters are
 * replayed; a `replace` and a `forbid` job overlap their own runs (a target that answers after
 * 2.5 s, every second); and one worker that does not lead is stopped gracefully and started again
 * once, at 40 % of the run. Every --sample-s (10) seconds, per node: RSS, the V8 heap used after a
 * forced full GC (bench/lib/resource-probe.mjs, preloaded), the handles keeping its event loop
 * busy (process.getActiveResourcesInfo()), open file descriptors and its TCP connections by
 * server (PostgreSQL, etcd, Kafka, targets), its PostgreSQL sessions (pg_stat_activity by
 * application_name), its /metrics series; for the cluster the keys and leases under its etcd
 * prefix and the jobs and dead letters in the database. A figure that grows with the operations
 * served rather than levelling off is a leak. Stops by itself after --minutes (5).
 *
 *   npm run build && npx tsx bench/churn.ts [--minutes 5] [--live 40] [--json churn.json] [--snapshots DIR]
 *   npx tsx bench/lib/heap-diff.ts DIR/PID-1.heapsnapshot DIR/PID-2.heapsnapshot   # what grew
 */
import {
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  readlinkSync,
  rmSync,
  writeFileSync,
} from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { ApiClient, ApiError } from '../src/cli/client.js';
import { REPO_ROOT, serverEnv } from '../test/support/env.js';
import type { ManagedProcess } from '../test/support/processes.js';
import { BenchCluster } from './lib/cluster.js';
import { machine } from './lib/stats.js';

/** One node's figures at one sample. */
export interface NodeSample {
  readonly node: string;
  readonly rssMb: number;
  /** V8 heap used right after a forced full GC, MB (the probe's latest line). */
  readonly heapMb: number;
  readonly externalMb: number;
  /** process.getActiveResourcesInfo() by kind (the probe's latest line). */
  readonly resources: Record<string, number>;
  readonly fds: number;
  /** Established TCP connections by remote server. */
  readonly sockets: Record<string, number>;
  readonly pgSessions: number;
  readonly metricSeries: number;
}

export interface ChurnSample {
  readonly second: number;
  /** API operations done so far, by kind. */
  readonly ops: Record<string, number>;
  readonly nodes: NodeSample[];
  readonly jobs: number;
  readonly openDeadLetters: number;
  readonly etcdKeys: number;
  readonly etcdLeases: number;
}

const SLOW_MS = 2500;

/** Six seconds of the minute, one in each ten, from n's last six digits: n's own schedule. */
function ownSeconds(n: number): string {
  return Array.from({ length: 6 }, (_, i) => 10 * i + (Math.floor(n / 10 ** i) % 10)).join(',');
}

/** A second target: /slow answers after 2.5 s (so runs of an every-second job overlap). */
function slowTarget(): Promise<{ server: Server; url: string }> {
  const server = createServer((req, res) => {
    req.resume();
    const timer = setTimeout(() => res.writeHead(200).end('ok'), SLOW_MS);
    res.on('close', () => clearTimeout(timer));
  });
  server.keepAliveTimeout = 60_000;
  return new Promise((resolve) =>
    server.listen(0, '127.0.0.1', () =>
      resolve({ server, url: `http://127.0.0.1:${(server.address() as AddressInfo).port}` }),
    ),
  );
}

function statusMb(pid: number, field: string): number {
  try {
    const match = new RegExp(`^${field}:\\s+(\\d+) kB`, 'm').exec(
      readFileSync(`/proc/${pid}/status`, 'utf8'),
    );
    return match ? Number(match[1]) / 1024 : NaN;
  } catch {
    return NaN;
  }
}

/** Open descriptors of `pid` and its established TCP connections by remote port's name. */
function descriptors(
  pid: number,
  ports: Map<number, string>,
): { fds: number; sockets: Record<string, number> } {
  let links: string[];
  try {
    links = readdirSync(`/proc/${pid}/fd`).map((fd) => {
      try {
        return readlinkSync(`/proc/${pid}/fd/${fd}`);
      } catch {
        return '';
      }
    });
  } catch {
    return { fds: NaN, sockets: {} };
  }
  const inodes = new Set(links.map((l) => /^socket:\[(\d+)\]$/.exec(l)?.[1]).filter((x) => x !== undefined));
  const sockets: Record<string, number> = {};
  for (const file of ['tcp', 'tcp6']) {
    let text: string;
    try {
      text = readFileSync(`/proc/${pid}/net/${file}`, 'utf8');
    } catch {
      continue;
    }
    for (const row of text.split('\n').slice(1)) {
      const cols = row.trim().split(/\s+/);
      if (cols.length < 10 || cols[3] !== '01' || !inodes.has(cols[9]!)) continue; // 01 = ESTABLISHED
      const remote = parseInt(cols[2]!.split(':')[1]!, 16);
      const local = parseInt(cols[1]!.split(':')[1]!, 16);
      const name = ports.get(remote) ?? (ports.has(local) ? `${ports.get(local)}-in` : 'other');
      sockets[name] = (sockets[name] ?? 0) + 1;
    }
  }
  return { fds: links.length, sockets };
}

/** The probe's latest line for `pid`. */
function probe(
  dir: string,
  pid: number,
): { heapUsed: number; external: number; resources: Record<string, number> } | undefined {
  try {
    const lines = readFileSync(join(dir, `${pid}.jsonl`), 'utf8')
      .trim()
      .split('\n');
    return JSON.parse(lines.at(-1)!) as {
      heapUsed: number;
      external: number;
      resources: Record<string, number>;
    };
  } catch {
    return undefined;
  }
}

function apiUrl(node: ManagedProcess): string | undefined {
  const started = node.logs.find((l) => l.msg === 'node started');
  return typeof started?.apiUrl === 'string' ? started.apiUrl : undefined;
}

async function metricSeries(url: string | undefined): Promise<number> {
  if (!url) return NaN;
  try {
    const text = await (await fetch(`${url}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
    return text.split('\n').filter((l) => l && !l.startsWith('#')).length;
  } catch {
    return NaN;
  }
}

const MB = 1024 * 1024;

export function describeSample(s: ChurnSample): string[] {
  const ops = Object.entries(s.ops)
    .map(([k, v]) => `${k} ${v}`)
    .join(', ');
  const lines = [
    `t=${String(s.second).padStart(3)} s: jobs ${s.jobs}, open dead letters ${s.openDeadLetters}, etcd keys ${s.etcdKeys} leases ${s.etcdLeases}; ops: ${ops}`,
  ];
  for (const n of s.nodes) {
    const resources = Object.entries(n.resources)
      .map(([k, v]) => `${k}:${v}`)
      .join(' ');
    const sockets = Object.entries(n.sockets)
      .sort()
      .map(([k, v]) => `${k}:${v}`)
      .join(' ');
    lines.push(
      `    ${n.node}: rss ${n.rssMb.toFixed(1)} MB, heap ${n.heapMb.toFixed(2)} MB, ext ${n.externalMb.toFixed(2)} MB, ` +
        `fds ${n.fds}, pg ${n.pgSessions}, series ${n.metricSeries}, tcp [${sockets}], handles [${resources}]`,
    );
  }
  return lines;
}

export async function churn(options: {
  minutes: number;
  live: number;
  sampleS: number;
  /** Keep the probe's lines here, with heap snapshots of every node at 30 % and at the end. */
  snapshots?: string;
  log?: (line: string) => void;
}): Promise<ChurnSample[]> {
  const log = options.log ?? (() => undefined);
  const probeDir = options.snapshots ?? mkdtempSync(join(tmpdir(), 'helios-churn-'));
  if (options.snapshots) mkdirSync(options.snapshots, { recursive: true });
  const slow = await slowTarget();
  const cluster = await BenchCluster.start({
    nodeArgs: ['--import', `${REPO_ROOT}bench/lib/resource-probe.mjs`],
    env: {
      HELIOS_BENCH_PROBE_DIR: probeDir,
      HELIOS_BENCH_PROBE_MS: String(options.sampleS * 1000),
    },
  });
  const servers = serverEnv();
  const port = (url: string) => Number(new URL(url.includes('://') ? url : `x://${url}`).port);
  const ports = new Map<number, string>([
    [port(servers.databaseUrl), 'pg'],
    [port(servers.etcdEndpoints.split(',')[0]!), 'etcd'],
    [port(servers.kafkaBrokers.split(',')[0]!), 'kafka'],
    [port(cluster.target.url), 'target'],
    [port(slow.url), 'slow'],
  ]);
  for (const node of cluster.live) {
    const url = apiUrl(node);
    if (url) ports.set(port(url), 'api');
  }
  const refused = 'http://127.0.0.1:9/down'; // discard port: nothing listens, the call is refused
  const samples: ChurnSample[] = [];
  const ops: Record<string, number> = {};
  const count = (op: string) => (ops[op] = (ops[op] ?? 0) + 1);
  const errors: Record<string, number> = {};
  const start = Date.now();
  const end = start + options.minutes * 60_000;
  const stop = new AbortController();
  let seq = 0;
  let rr = 0;
  const client = (): ApiClient => {
    const urls = cluster.live.map(apiUrl).filter((u): u is string => u !== undefined);
    return new ApiClient({ apiUrl: urls[rr++ % urls.length]!, apiToken: undefined });
  };
  const attempt = async (op: string, call: () => Promise<unknown>): Promise<boolean> => {
    try {
      await call();
      count(op);
      return true;
    } catch (err) {
      const key = `${op}:${err instanceof ApiError ? err.status : err instanceof Error ? err.name : 'error'}`;
      errors[key] = (errors[key] ?? 0) + 1;
      return false;
    }
  };
  const pick = <T>(items: T[]): T | undefined => items[Math.floor(Math.random() * items.length)];

  try {
    // The two overlapping jobs live for the whole run.
    for (const concurrency of ['replace', 'forbid'] as const) {
      await client().createJob({
        name: `overlap-${concurrency}`,
        schedule: '* * * * * *',
        target: { url: `${slow.url}/slow` },
        timeoutMs: 10_000,
        retry: { maxAttempts: 1, backoffMs: 0 },
        concurrency,
      });
    }
    const live: string[] = [];
    const churnLoop = async (): Promise<void> => {
      while (!stop.signal.aborted) {
        const n = seq++;
        const failing = n % 10 === 0;
        const name = `churn-${n}`;
        const created = await attempt('create', () =>
          client().createJob({
            name,
            // Half the jobs have a schedule of their own (six seconds of each minute, one in each
            // ten, chosen by n's digits): as users' schedules are, not all alike.
            schedule: n % 2 === 1 ? `${ownSeconds(n)} * * * * *` : `*/${2 + (n % 4)} * * * * *`,
            target: {
              url: failing ? refused : `${cluster.target.url}/c/${n}`,
              method: 'POST',
              headers: { 'x-churn': String(n) },
              body: { n },
            },
            timeoutMs: 5000,
            retry: failing ? { maxAttempts: 1, backoffMs: 0 } : { maxAttempts: 2, backoffMs: 500 },
            concurrency: (['allow', 'forbid', 'replace'] as const)[n % 3],
          }),
        );
        if (created) live.push(name);
        // A few operations on jobs that exist.
        for (let i = 0; i < 3; i++) {
          const job = pick(live);
          if (!job) break;
          const m = seq + i;
          switch (Math.floor(Math.random() * 7)) {
            case 0:
              await attempt('pause', () => client().pauseJob(job));
              break;
            case 1:
              await attempt('resume', () => client().resumeJob(job));
              break;
            case 2:
              await attempt('patch-schedule', () =>
                client().patchJob(job, { schedule: `*/${2 + (m % 5)} * * * * *` }),
              );
              break;
            case 3:
              await attempt('patch-target', () =>
                client().patchJob(job, {
                  target: { url: `${cluster.target.url}/p/${m}`, headers: { 'x-p': String(m) } },
                }),
              );
              break;
            case 4:
              await attempt('patch-headers', () =>
                client().patchJob(job, {
                  target: { url: `${cluster.target.url}/h/${job}`, headers: { [`x-h-${m % 7}`]: String(m) } },
                }),
              );
              break;
            default:
              await attempt('trigger', () => client().triggerJob(job));
          }
        }
        while (live.length > options.live) {
          const old = live.shift()!;
          await attempt('delete', () => client().deleteJob(old));
        }
        await sleep(50, undefined, { signal: stop.signal }).catch(() => undefined);
      }
    };
    const replayLoop = async (): Promise<void> => {
      while (!stop.signal.aborted) {
        await sleep(2000, undefined, { signal: stop.signal }).catch(() => undefined);
        if (stop.signal.aborted) break;
        try {
          const open = await client().listDeadLetters({ open: true, max: 20 });
          for (const letter of open) await attempt('replay', () => client().replayDeadLetter(letter.id));
        } catch {
          errors['list-dead-letters'] = (errors['list-dead-letters'] ?? 0) + 1;
        }
      }
    };
    const restartLoop = async (): Promise<void> => {
      await sleep(start + (end - start) * 0.4 - Date.now(), undefined, { signal: stop.signal }).catch(
        () => undefined,
      );
      if (stop.signal.aborted) return;
      const { node: leader } = await cluster.leader();
      const worker = cluster.live.find((n) => n !== leader)!;
      const stoppedAt = Date.now();
      await worker.stop(20_000);
      log(
        `restart: ${worker.name} stopped gracefully in ${Date.now() - stoppedAt} ms (exit ${JSON.stringify(await worker.exited)})`,
      );
      const fresh = cluster.spawn();
      await fresh.waitForLog((l) => l.msg === 'node started', 60_000);
      const url = apiUrl(fresh);
      if (url) ports.set(port(url), 'api');
      count('restart');
      log(`restart: ${fresh.name} started`);
    };
    const sampleLoop = async (): Promise<void> => {
      for (let k = 1; ; k++) {
        await sleep(Math.max(0, start + k * options.sampleS * 1000 + 1500 - Date.now()), undefined, {
          signal: stop.signal,
        }).catch(() => undefined);
        if (stop.signal.aborted) return;
        const { rows: sessions } = await cluster.db.pool.query<{ name: string; n: string }>(
          `SELECT application_name AS name, count(*) AS n FROM pg_stat_activity WHERE datname = $1 GROUP BY 1`,
          [cluster.db.name],
        );
        const { rows: db } = await cluster.db.pool.query<{ jobs: string; letters: string }>(
          `SELECT (SELECT count(*) FROM jobs) AS jobs,
                  (SELECT count(*) FROM dead_letters WHERE replayed_at IS NULL) AS letters`,
        );
        const kvs = await cluster.etcd.getAll().prefix(cluster.nodeEnv.etcdPrefix).exec();
        const leases = new Set(kvs.kvs.map((kv) => kv.lease).filter((l) => String(l) !== '0'));
        const nodes: NodeSample[] = [];
        for (const node of cluster.live) {
          const p = probe(probeDir, node.pid);
          const d = descriptors(node.pid, ports);
          nodes.push({
            node: node.name,
            rssMb: statusMb(node.pid, 'VmRSS'),
            heapMb: p ? p.heapUsed / MB : NaN,
            externalMb: p ? p.external / MB : NaN,
            resources: p?.resources ?? {},
            fds: d.fds,
            sockets: d.sockets,
            pgSessions: sessions
              .filter((s) => s.name === `helios-${node.name}` || s.name.includes(`:${node.name}`))
              .reduce((a, s) => a + Number(s.n), 0),
            metricSeries: await metricSeries(apiUrl(node)),
          });
        }
        const sample: ChurnSample = {
          second: Math.round((Date.now() - start) / 1000),
          ops: { ...ops },
          nodes,
          jobs: Number(db[0]!.jobs),
          openDeadLetters: Number(db[0]!.letters),
          etcdKeys: kvs.kvs.length,
          etcdLeases: leases.size,
        };
        samples.push(sample);
        for (const line of describeSample(sample)) log(line);
      }
    };
    const snapshot = async (when: string): Promise<void> => {
      if (!options.snapshots) return;
      for (const node of cluster.live) {
        node.signal('SIGUSR2');
        log(`heap snapshot (${when}) of ${node.name}, pid ${node.pid}, ops ${JSON.stringify(ops)}`);
        await sleep(3000); // one at a time: each takes a second or two of CPU
      }
    };
    const loops = [churnLoop(), replayLoop(), restartLoop(), sampleLoop()];
    await sleep(Math.max(0, start + (end - start) * 0.3 - Date.now()));
    await snapshot('30 %');
    await sleep(Math.max(0, end - Date.now()));
    await snapshot('end');
    stop.abort();
    await Promise.all(loops);
    log(`errors: ${JSON.stringify(errors)}`);
    log(`target: ${cluster.target.count} calls, ${cluster.target.duplicates} repeated a run id`);
    const warnings = cluster.incidents(start).filter((l) => !/elect|leader|run is dead/i.test(l));
    log(`warnings/errors logged by the nodes: ${warnings.length}`);
    for (const line of warnings.slice(0, 15)) log(`  ${line.slice(0, 300)}`);
    return samples;
  } finally {
    await cluster.stop();
    await new Promise((resolve) => slow.server.close(resolve));
    slow.server.closeAllConnections();
    if (!options.snapshots) rmSync(probeDir, { recursive: true, force: true });
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      minutes: { type: 'string', default: '5' },
      live: { type: 'string', default: '40' },
      'sample-s': { type: 'string', default: '10' },
      json: { type: 'string' },
      snapshots: { type: 'string' },
    },
  });
  console.log(`churn: 3 nodes, ${values.live} live jobs churned for ${values.minutes} min, ${machine()}`);
  const samples = await churn({
    minutes: Number(values.minutes),
    live: Number(values.live),
    sampleS: Number(values['sample-s']),
    snapshots: values.snapshots,
    log: (line) => console.log(`  ${line}`),
  });
  if (values.json) writeFileSync(values.json, JSON.stringify(samples, null, 2));
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
