import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { randomBytes } from 'node:crypto';
import { connect } from 'node:net';
import type { Etcd3 } from 'etcd3';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { readLeader } from '../../src/coordination/election.js';
import { REPO_ROOT, serverEnv } from '../support/env.js';
import { infra, ManagedProcess, nodeEnvironment, type NodeEnv } from '../support/processes.js';
import { TcpProxy } from '../support/tcp-proxy.js';
import { EtcdCluster } from './etcd-cluster.js';
import { ChaosNetwork, type Peer } from './netns.js';

/** The servers a node can be cut from. */
export type Server = 'postgres' | 'kafka' | 'etcd';

/**
 * The chaos cluster: N real nodes (the hooked-node fixture: the same composition as
 * `helios node`, plus IPC gates for holding a leader write) on a three-member etcd cluster of
 * their own. When network namespaces work (root, `ip`, `nft`), every node and every etcd member
 * runs in its own namespace on a private bridge (see netns.ts), so a node can be cut by packet
 * filtering from etcd, PostgreSQL, Kafka or everything. Otherwise the nodes run in the root
 * namespace and reach etcd through one TCP proxy per member, the only partition left; `netns`
 * is null and `netnsProblem` says why.
 *
 * Ports: in the namespaces every host has its own port space, so the etcd members use this
 * checkout's etcd client and peer ports and the nodes' API 8080; Kafka's listener for the
 * namespaces is HELIOS_KAFKA_NETNS_PORT (default etcd port + 20). Without namespaces the etcd
 * members use etcd port + 2 … + 7 and the nodes' API etcd port + 11 … + 13. All inside the block
 * of ports given to one checkout (etcd port … + 20).
 */
export class ChaosCluster {
  /** Every process ever started (killed ones keep their logs for the checker). */
  readonly history: ManagedProcess[] = [];
  readonly live = new Map<string, ManagedProcess>();
  /** Without namespaces only: per node, one proxy per etcd member. */
  readonly proxies = new Map<string, TcpProxy[]>();
  /** A client of the chaos etcd cluster for the test itself (leader lookups). */
  readonly etcd: Etcd3;
  /** The admin token of the nodes' API (their API listens on an address other hosts reach). */
  readonly apiToken = randomBytes(18).toString('hex');
  /** Address the target server must listen on for the nodes to reach it. */
  readonly targetHost: string;
  private readonly apiUrls = new Map<string, string>();
  private readonly env: NodeEnv;
  private readonly servers: { pgPort: number; kafka: string };

  private constructor(
    env: NodeEnv,
    readonly names: string[],
    readonly network: ChaosNetwork | null,
    readonly netnsProblem: string | null,
    readonly etcdCluster: EtcdCluster,
    private readonly etcdBasePort: number,
    kafkaNetnsPort: number,
  ) {
    const host = network?.hostAddress;
    const db = new URL(env.databaseUrl);
    this.servers = {
      pgPort: Number(db.port),
      kafka: host ? `${host}:${kafkaNetnsPort}` : serverEnv().kafkaBrokers,
    };
    if (host) db.hostname = host;
    this.env = { ...env, databaseUrl: db.toString() };
    this.targetHost = host ?? '127.0.0.1';
    this.etcd = createEtcdClient(etcdCluster.endpoints);
  }

  /**
   * Builds the network (deleting what a crashed run of this checkout left), makes PostgreSQL and
   * Kafka listen on it, and starts the etcd cluster; nodes start with `start()`.
   */
  static async create(env: NodeEnv, names: string[], log: (m: string) => void): Promise<ChaosCluster> {
    const etcdBasePort = Number(new URL(serverEnv().etcdEndpoints.split(',')[0]!).port);
    const tag = `hx${etcdBasePort}`;
    const kafkaNetnsPort = Number(process.env.HELIOS_KAFKA_NETNS_PORT ?? etcdBasePort + 20);
    const stateDir = `${REPO_ROOT}.helios/chaos-etcd`;
    const leftovers = ChaosNetwork.cleanLeftovers(tag);
    if (leftovers.length) log(`removed leftovers of an earlier run: ${leftovers.join(' ')}`);
    // CHAOS_NO_NETNS=1 forces the fallback, to test it where namespaces do work.
    const problem = process.env.CHAOS_NO_NETNS
      ? 'CHAOS_NO_NETNS is set'
      : await ChaosNetwork.unavailableReason(tag);
    let network: ChaosNetwork | null = null;
    if (problem) {
      log('!!!!! NETWORK NAMESPACES UNAVAILABLE: ' + problem);
      log('!!!!! falling back to TCP proxies: only "partition-etcd-both" can be injected (no');
      log('!!!!! PostgreSQL, Kafka, one-way or etcd-member partitions); run as root with ip and nft');
    } else {
      network = await ChaosNetwork.create(tag, etcdBasePort % 250);
      log(`network namespaces: bridge ${network.hostAddress}/24, one namespace per node and etcd member`);
      // Every later infra.sh call (restarts by faults, the final `up`) keeps these listeners.
      process.env.HELIOS_NETNS_HOST = network.hostAddress;
      process.env.HELIOS_KAFKA_NETNS_PORT = String(kafkaNetnsPort);
      const pgPort = Number(new URL(env.databaseUrl).port);
      for (const [server, port] of [
        ['pg', pgPort],
        ['kafka', kafkaNetnsPort],
      ] as const) {
        if (await reachable(network.hostAddress, port)) continue;
        log(`restarting ${server} so it also listens on ${network.hostAddress}:${port}`);
        await infra('down', server);
        await infra('up', server);
      }
    }
    const etcdCluster = new EtcdCluster(stateDir, network, {
      client: etcdBasePort,
      peer: etcdBasePort + 1,
      fallbackPort: etcdBasePort + 2,
    });
    const cluster = new ChaosCluster(env, names, network, problem, etcdCluster, etcdBasePort, kafkaNetnsPort);
    cluster.cleanUpOnExit();
    await etcdCluster.start();
    log(`etcd cluster: ${etcdCluster.endpoints.join(' ')}`);
    return cluster;
  }

  async start(): Promise<void> {
    for (const [i, name] of this.names.entries()) {
      if (this.network) {
        await this.network.addHost(name, 11 + i);
      } else {
        const proxies: TcpProxy[] = [];
        for (const m of this.etcdCluster.members) {
          const proxy = new TcpProxy('127.0.0.1', Number(new URL(m.clientUrl).port));
          await proxy.listen();
          proxies.push(proxy);
        }
        this.proxies.set(name, proxies);
      }
    }
    await Promise.all(this.names.map((name) => this.spawn(name)));
  }

  async spawn(name: string): Promise<ManagedProcess> {
    const index = this.names.indexOf(name);
    const env = nodeEnvironment(name, this.env);
    env.HELIOS_KAFKA_BROKERS = this.servers.kafka;
    env.HELIOS_API_TOKENS = `${this.apiToken}:admin`;
    let apiUrl: string;
    if (this.network) {
      const address = this.network.hosts.get(name)!.address;
      env.HELIOS_ETCD_ENDPOINTS = this.etcdCluster.endpoints.join(',');
      env.HELIOS_HTTP_HOST = address;
      env.HELIOS_HTTP_PORT = '8080';
      apiUrl = `http://${address}:8080`;
    } else {
      env.HELIOS_ETCD_ENDPOINTS = this.proxies
        .get(name)!
        .map((p) => `http://127.0.0.1:${p.port}`)
        .join(',');
      env.HELIOS_HTTP_PORT = String(this.etcdBasePort + 11 + index);
      apiUrl = `http://127.0.0.1:${env.HELIOS_HTTP_PORT}`;
    }
    this.apiUrls.set(name, apiUrl);
    const script = [`--import`, 'tsx', `${REPO_ROOT}test/fixtures/hooked-node.ts`];
    const [command, args] = this.network
      ? this.network.wrap(name, process.execPath, script)
      : [process.execPath, script];
    // `ip netns exec` execs the node in place, so the pid, signals and the IPC channel are the node's.
    const child = spawn(command, args, { env, stdio: ['ignore', 'pipe', 'pipe', 'ipc'], cwd: REPO_ROOT });
    const node = new ManagedProcess(name, child);
    node.child.on('error', () => undefined);
    this.history.push(node);
    this.live.set(name, node);
    await node.waitForLog((l) => l.msg === 'node started', 60_000);
    return node;
  }

  /** Base URL of a node's API (send `authorization: Bearer ${apiToken}`). */
  apiUrl(name: string): string {
    return this.apiUrls.get(name)!;
  }

  /** The addresses (and ports) of a server as the nodes reach it, for a partition. */
  peers(server: Server): Peer[] {
    const host = this.network!.hostAddress;
    switch (server) {
      case 'postgres':
        return [{ address: host, port: this.servers.pgPort }];
      case 'kafka':
        return [{ address: host, port: Number(this.servers.kafka.split(':')[1]) }];
      case 'etcd':
        return this.etcdCluster.members.map((m) => ({ address: m.address }));
    }
  }

  /** The node etcd names as leader, waiting up to `timeoutMs` for one. */
  async leader(timeoutMs = 20_000): Promise<ManagedProcess> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const record = await readLeader(this.etcd, `${this.env.etcdPrefix}/leader`).catch(() => null);
      const node = record ? this.live.get(record.nodeId) : undefined;
      if (node?.running) return node;
      if (Date.now() > deadline) throw new Error('no leader');
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  /** Arms the node's next leader write to wait, and resolves when one is waiting (or after `ms`). */
  holdNextWrite(node: ManagedProcess, ms: number): Promise<boolean> {
    return holdNextWrite(node, ms);
  }

  releaseWrite(node: ManagedProcess): void {
    releaseWrite(node);
  }

  /** Stops the nodes, the proxies, the etcd cluster, and deletes the network. Safe to call twice. */
  async stop(): Promise<void> {
    await Promise.allSettled([...this.live.values()].map((n) => n.stop()));
    await Promise.allSettled([...this.proxies.values()].flat().map((p) => p.close()));
    this.etcd.close();
    await this.etcdCluster.stop().catch(() => undefined);
    this.network?.destroy();
    // The bridge address is gone: a server (re)started from now on listens on loopback only.
    delete process.env.HELIOS_NETNS_HOST;
  }

  /** On Ctrl-C, SIGTERM or any exit: kill what we started and delete the network, synchronously. */
  private cleanUpOnExit(): void {
    const now = () => {
      for (const node of this.live.values()) node.signal('SIGKILL');
      this.etcdCluster.killAll();
      this.network?.destroy();
    };
    process.once('exit', now);
    for (const signal of ['SIGINT', 'SIGTERM'] as const) {
      process.once(signal, () => {
        now();
        process.exit(130);
      });
    }
  }
}

/**
 * Arms a hooked node's next leader write (test/fixtures/hooked-node.ts) to wait after its
 * leadership check, and resolves true when one is waiting, false if none came within `ms`.
 */
export async function holdNextWrite(node: ManagedProcess, ms: number): Promise<boolean> {
  node.child.send({ hold: 'write' });
  const pending = (async () => {
    for (;;) {
      const [message] = (await once(node.child, 'message')) as [{ pending?: string }];
      if (message.pending === 'write') return true;
    }
  })();
  return Promise.race([pending, new Promise<boolean>((r) => setTimeout(() => r(false), ms))]);
}

/** Lets a held write go on (and disarms a hold that caught none). */
export function releaseWrite(node: ManagedProcess): void {
  if (node.running) node.child.send({ release: 'write' });
}

/** True if a TCP connection to address:port opens within a second. */
function reachable(address: string, port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect({ host: address, port, timeout: 1000 });
    const done = (ok: boolean) => {
      socket.destroy();
      resolve(ok);
    };
    socket.once('connect', () => done(true));
    socket.once('error', () => done(false));
    socket.once('timeout', () => done(false));
  });
}
