import { once } from 'node:events';
import type { Etcd3 } from 'etcd3';
import { readLeader } from '../../src/coordination/election.js';
import { nodeEnvironment, spawnFixture, type ManagedProcess, type NodeEnv } from '../support/processes.js';
import { TcpProxy } from '../support/tcp-proxy.js';

/**
 * The chaos cluster: N real nodes (the hooked-node fixture: the same composition as
 * `helios node`, plus IPC gates for holding a leader write), each reaching etcd through its own
 * TCP proxy so one node can be cut off from etcd alone while it still reaches PostgreSQL.
 */
export class ChaosCluster {
  /** Every process ever started (killed ones keep their logs for the checker). */
  readonly history: ManagedProcess[] = [];
  readonly live = new Map<string, ManagedProcess>();
  readonly proxies = new Map<string, TcpProxy>();

  constructor(
    private readonly env: NodeEnv,
    private readonly etcd: Etcd3,
    private readonly etcdPort: number,
    readonly names: string[],
  ) {}

  async start(): Promise<void> {
    for (const name of this.names) {
      const proxy = new TcpProxy('127.0.0.1', this.etcdPort);
      await proxy.listen();
      this.proxies.set(name, proxy);
    }
    await Promise.all(this.names.map((name) => this.spawn(name)));
  }

  async spawn(name: string): Promise<ManagedProcess> {
    const proxy = this.proxies.get(name)!;
    const env = nodeEnvironment(name, this.env);
    env.HELIOS_ETCD_ENDPOINTS = `http://127.0.0.1:${proxy.port}`;
    const node = spawnFixture(name, 'test/fixtures/hooked-node.ts', env);
    node.child.on('error', () => undefined);
    this.history.push(node);
    this.live.set(name, node);
    await node.waitForLog((l) => l.msg === 'node started', 60_000);
    return node;
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
  async holdNextWrite(node: ManagedProcess, ms: number): Promise<boolean> {
    node.child.send({ hold: 'write' });
    const pending = (async () => {
      for (;;) {
        const [message] = (await once(node.child, 'message')) as [{ pending?: string }];
        if (message.pending === 'write') return true;
      }
    })();
    return Promise.race([pending, new Promise<boolean>((r) => setTimeout(() => r(false), ms))]);
  }

  releaseWrite(node: ManagedProcess): void {
    if (node.running) node.child.send({ release: 'write' });
  }

  async stop(): Promise<void> {
    await Promise.allSettled([...this.live.values()].map((n) => n.stop()));
    await Promise.allSettled([...this.proxies.values()].map((p) => p.close()));
  }
}
