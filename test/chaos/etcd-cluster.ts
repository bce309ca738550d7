import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { existsSync, mkdirSync, openSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import type { ChaosNetwork } from './netns.js';

/** One etcd member: a local `etcd` process, in its own network namespace when there is a network. */
export interface EtcdMember {
  readonly name: string;
  readonly address: string;
  readonly clientUrl: string;
  readonly peerUrl: string;
  readonly dir: string;
  process?: ChildProcess;
}

/**
 * A three-member etcd cluster for the chaos test (the Debian `etcd` binary, as scripts/infra.sh
 * starts the single one), fresh for each run. With a ChaosNetwork each member runs in its own
 * namespace (same ports in each, the namespaces have their own port spaces), so one member can be
 * partitioned from the other two and from every client at once; without one, the members listen
 * on 127.0.0.1 on `fallbackPort`, +1, … +5 and cannot be partitioned.
 */
export class EtcdCluster {
  readonly members: EtcdMember[] = [];

  constructor(
    private readonly dir: string,
    private readonly network: ChaosNetwork | null,
    ports: { client: number; peer: number; fallbackPort: number },
    count = 3,
  ) {
    for (let i = 1; i <= count; i++) {
      const name = `etcd-${i}`;
      const address = network ? `10.200.${network.octet}.${100 + i}` : '127.0.0.1';
      const client = network ? ports.client : ports.fallbackPort + 2 * (i - 1);
      const peer = network ? ports.peer : ports.fallbackPort + 2 * (i - 1) + 1;
      this.members.push({
        name,
        address,
        clientUrl: `http://${address}:${client}`,
        peerUrl: `http://${address}:${peer}`,
        dir: `${dir}/${name}`,
      });
    }
  }

  get endpoints(): string[] {
    return this.members.map((m) => m.clientUrl);
  }

  /** Kills members a crashed earlier run left running (by their recorded pid) and deletes their data. */
  static cleanLeftovers(dir: string): void {
    for (const name of ['etcd-1', 'etcd-2', 'etcd-3']) {
      const pidFile = `${dir}/${name}/pid`;
      if (!existsSync(pidFile)) continue;
      const pid = Number(readFileSync(pidFile, 'utf8'));
      try {
        // Only if that pid is still an etcd of this data directory (pids are reused).
        if (readFileSync(`/proc/${pid}/cmdline`, 'utf8').includes(`${dir}/${name}/data`))
          process.kill(pid, 'SIGKILL');
      } catch {
        // gone
      }
    }
    rmSync(dir, { recursive: true, force: true });
  }

  async start(): Promise<void> {
    EtcdCluster.cleanLeftovers(this.dir);
    for (const m of this.members) {
      if (this.network) await this.network.addHost(m.name, 100 + Number(m.name.slice(5)));
      this.startMember(m);
    }
    await this.waitHealthy(30_000);
  }

  /** Starts (or restarts, on its existing data) one member; returns without waiting. */
  startMember(m: EtcdMember): void {
    mkdirSync(m.dir, { recursive: true });
    const args = [
      '--name', m.name,
      '--data-dir', `${m.dir}/data`,
      '--listen-client-urls', m.clientUrl,
      '--advertise-client-urls', m.clientUrl,
      '--listen-peer-urls', m.peerUrl,
      '--initial-advertise-peer-urls', m.peerUrl,
      '--initial-cluster', this.members.map((o) => `${o.name}=${o.peerUrl}`).join(','),
      '--initial-cluster-state', 'new',
      '--initial-cluster-token', `helios-chaos-${this.dir.length}`,
      // Without pre-vote (off by default in etcd 3.4) an isolated member keeps raising its term and,
      // when it comes back, forces an election: the cluster had no leader for ~7 s after every heal.
      '--pre-vote',
      '--log-level', 'warn',
      '--logger', 'zap',
    ]; // prettier-ignore
    const [command, argv] = this.network ? this.network.wrap(m.name, 'etcd', args) : ['etcd', args];
    const log = openSync(`${m.dir}/etcd.log`, 'a');
    m.process = spawn(command, argv, { stdio: ['ignore', log, log] });
    m.process.on('error', () => undefined);
    writeFileSync(`${m.dir}/pid`, String(m.process.pid));
  }

  running(m: EtcdMember): boolean {
    return !!m.process && m.process.exitCode === null && m.process.signalCode === null;
  }

  async stopMember(m: EtcdMember, signal: NodeJS.Signals = 'SIGTERM'): Promise<void> {
    if (!this.running(m)) return;
    const exited = once(m.process!, 'exit');
    m.process!.kill(signal);
    const timer = setTimeout(() => m.process?.kill('SIGKILL'), 5000);
    await exited;
    clearTimeout(timer);
  }

  async stop(): Promise<void> {
    await Promise.all(this.members.map((m) => this.stopMember(m)));
  }

  /** Kills the members at once (for exit paths that cannot wait). */
  killAll(): void {
    for (const m of this.members) if (this.running(m)) m.process!.kill('SIGKILL');
  }

  /** One member's maintenance status through etcd's JSON gateway, or null if it does not answer. */
  async status(m: EtcdMember): Promise<{ memberId: string; leader: string } | null> {
    try {
      const res = await fetch(`${m.clientUrl}/v3/maintenance/status`, {
        method: 'POST',
        body: '{}',
        signal: AbortSignal.timeout(1000),
      });
      if (!res.ok) return null;
      const body = (await res.json()) as { header?: { member_id?: string }; leader?: string };
      return { memberId: body.header?.member_id ?? '', leader: body.leader ?? '0' };
    } catch {
      return null;
    }
  }

  /** The member the others agree is the raft leader, waiting up to `timeoutMs` for one. */
  async leader(timeoutMs = 20_000): Promise<EtcdMember> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const statuses = await Promise.all(this.members.map((m) => this.status(m)));
      const leaderId = statuses.find((s) => s && s.leader !== '0')?.leader;
      const index = statuses.findIndex((s) => s?.memberId === leaderId);
      if (index >= 0) return this.members[index]!;
      if (Date.now() > deadline) throw new Error('the etcd cluster has no leader');
      await sleep(200);
    }
  }

  /** Waits until every running member says it is healthy (it has a leader and serves reads). */
  async waitHealthy(timeoutMs: number): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const healthy = await Promise.all(
        this.members.map(async (m) => {
          if (!this.running(m)) return false;
          try {
            const res = await fetch(`${m.clientUrl}/health`, { signal: AbortSignal.timeout(1500) });
            return ((await res.json()) as { health?: string }).health === 'true';
          } catch {
            return false;
          }
        }),
      );
      if (healthy.every(Boolean)) return;
      if (Date.now() > deadline) {
        const tails = this.members.map((m) => {
          const log = existsSync(`${m.dir}/etcd.log`) ? readFileSync(`${m.dir}/etcd.log`, 'utf8') : '';
          return `${m.name} (${this.running(m) ? 'running' : 'not running'}): ${log.split('\n').slice(-5).join('\n')}`;
        });
        throw new Error(`etcd cluster not healthy after ${timeoutMs} ms:\n${tails.join('\n')}`);
      }
      await sleep(250);
    }
  }
}
