import { execFile, execFileSync } from 'node:child_process';
import { promisify } from 'node:util';

const exec = promisify(execFile);

/**
 * A private network for the chaos test: one Linux bridge in the root namespace with the address
 * `10.200.<octet>.1/24`, and one network namespace per host (node or etcd member), joined to the
 * bridge by a veth pair, with its own address in that /24. Nothing is routed: the namespaces have
 * no default route, so they reach only the bridge's /24 (the servers listen on the bridge address,
 * see scripts/infra.sh HELIOS_NETNS_HOST), and nothing outside this machine sees the subnet.
 *
 * Partitions are real packet drops: an nft table inside the host's namespace drops the traffic
 * to or from chosen peers (address and optionally port), in one direction or both. TCP sees
 * silence, not resets, as with a failed switch; after `heal()` the stalled connections resume by
 * retransmission. Everything is named after `tag` (from this checkout's etcd port) so two
 * checkouts on one machine never touch each other's namespaces, and a fresh run can delete what a
 * crashed run left behind (`cleanLeftovers`).
 */
export type Direction = 'both' | 'inbound' | 'outbound';

/** A peer to cut: an address, and a TCP port on it (all ports when absent). */
export interface Peer {
  readonly address: string;
  readonly port?: number;
}

export interface NetHost {
  readonly name: string;
  readonly namespace: string;
  readonly address: string;
}

const TABLE = 'helios_chaos';

async function sh(command: string, ...args: string[]): Promise<string> {
  try {
    const { stdout } = await exec(command, args, { timeout: 15_000 });
    return stdout;
  } catch (err) {
    const e = err as { stderr?: string; message: string };
    throw new Error(`${command} ${args.join(' ')}: ${(e.stderr ?? '').trim() || e.message}`, { cause: err });
  }
}

function nftScript(namespace: string, script: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const child = execFile('ip', ['netns', 'exec', namespace, 'nft', '-f', '-'], (err, _out, stderr) =>
      err ? reject(new Error(`nft in ${namespace}: ${stderr.trim() || err.message}`)) : resolve(),
    );
    child.stdin!.end(script);
  });
}

export class ChaosNetwork {
  readonly hostAddress: string;
  readonly hosts = new Map<string, NetHost>();
  private readonly bridge: string;
  private destroyed = false;

  private constructor(
    readonly tag: string,
    readonly octet: number,
  ) {
    this.hostAddress = `10.200.${octet}.1`;
    this.bridge = `${tag}br`;
  }

  /**
   * Why namespaces cannot be used here (not root, no `ip` or `nft`, no permission), or null when
   * they can: a throwaway namespace is created, filtered and deleted.
   */
  static async unavailableReason(tag: string): Promise<string | null> {
    if (process.getuid?.() !== 0) return 'not running as root';
    const probe = `${tag}-probe`;
    try {
      await sh('ip', 'netns', 'add', probe);
      await nftScript(
        probe,
        `table inet ${TABLE} {\n chain output { type filter hook output priority 0; }\n}\n`,
      );
      return null;
    } catch (err) {
      return (err as Error).message;
    } finally {
      await sh('ip', 'netns', 'del', probe).catch(() => undefined);
    }
  }

  /** Deletes namespaces and the bridge named after `tag`, killing what still runs inside them. */
  static cleanLeftovers(tag: string): string[] {
    const removed: string[] = [];
    let list: string;
    try {
      list = execFileSync('ip', ['netns', 'list'], { encoding: 'utf8' });
    } catch {
      return removed;
    }
    for (const line of list.split('\n')) {
      const namespace = line.split(' ')[0]!;
      if (!namespace.startsWith(`${tag}-`)) continue;
      // Processes a crashed run left in its own namespaces (nodes, etcd members), by pid.
      const pids = execFileSync('ip', ['netns', 'pids', namespace], { encoding: 'utf8' })
        .split('\n')
        .filter(Boolean)
        .map(Number);
      for (const pid of pids) {
        try {
          process.kill(pid, 'SIGKILL');
        } catch {
          // already gone
        }
      }
      try {
        execFileSync('ip', ['netns', 'del', namespace]);
        removed.push(namespace);
      } catch {
        // reported by the caller's next attempt
      }
    }
    // The kernel frees a namespace (and the veth ends in it) only after its last process is
    // reaped, so the host ends and the bridge are deleted by name: deleting one end of a veth
    // deletes the pair.
    const links = execFileSync('ip', ['-o', 'link', 'show'], { encoding: 'utf8' })
      .split('\n')
      .map((line) => line.split(': ')[1]?.split('@')[0] ?? '')
      .filter((name) => name.startsWith(`${tag}v`) || name === `${tag}br`);
    for (const link of links) {
      try {
        execFileSync('ip', ['link', 'del', link], { stdio: 'ignore' });
        removed.push(link);
      } catch {
        // went away with its namespace meanwhile
      }
    }
    return removed;
  }

  static async create(tag: string, octet: number): Promise<ChaosNetwork> {
    const net = new ChaosNetwork(tag, octet);
    await sh('ip', 'link', 'add', net.bridge, 'type', 'bridge');
    await sh('ip', 'addr', 'add', `${net.hostAddress}/24`, 'dev', net.bridge);
    await sh('ip', 'link', 'set', net.bridge, 'up');
    return net;
  }

  /** A new namespace `<tag>-<name>` at `10.200.<octet>.<index>`, with an empty filter table. */
  async addHost(name: string, index: number): Promise<NetHost> {
    const namespace = `${this.tag}-${name}`;
    const veth = `${this.tag}v${index}`;
    const address = `10.200.${this.octet}.${index}`;
    await sh('ip', 'netns', 'add', namespace);
    await sh('ip', 'link', 'add', veth, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', namespace);
    await sh('ip', 'link', 'set', veth, 'master', this.bridge, 'up');
    await sh('ip', 'netns', 'exec', namespace, 'ip', 'addr', 'add', `${address}/24`, 'dev', 'eth0');
    await sh('ip', 'netns', 'exec', namespace, 'ip', 'link', 'set', 'eth0', 'up');
    await sh('ip', 'netns', 'exec', namespace, 'ip', 'link', 'set', 'lo', 'up');
    await nftScript(
      namespace,
      `table inet ${TABLE} {
         chain input { type filter hook input priority 0; policy accept; }
         chain output { type filter hook output priority 0; policy accept; }
       }\n`,
    );
    const host = { name, namespace, address };
    this.hosts.set(name, host);
    return host;
  }

  /** The command line that runs `command` inside the host's namespace. */
  wrap(name: string, command: string, args: string[]): [string, string[]] {
    return ['ip', ['netns', 'exec', this.host(name).namespace, command, ...args]];
  }

  /**
   * Drops the host's traffic with `peers` (or with everything but its loopback when `peers` is
   * 'all'): `outbound` drops what the host sends, `inbound` what it receives, `both` both.
   */
  async cut(name: string, peers: readonly Peer[] | 'all', direction: Direction): Promise<void> {
    const rules: string[] = [];
    const out = direction !== 'inbound';
    const inb = direction !== 'outbound';
    if (peers === 'all') {
      if (out) rules.push(`add rule inet ${TABLE} output oifname != "lo" drop`);
      if (inb) rules.push(`add rule inet ${TABLE} input iifname != "lo" drop`);
    }
    for (const peer of peers === 'all' ? [] : peers) {
      const port = (field: string) => (peer.port === undefined ? '' : ` tcp ${field} ${peer.port}`);
      if (out) rules.push(`add rule inet ${TABLE} output ip daddr ${peer.address}${port('dport')} drop`);
      if (inb) rules.push(`add rule inet ${TABLE} input ip saddr ${peer.address}${port('sport')} drop`);
    }
    await nftScript(this.host(name).namespace, rules.join('\n') + '\n');
  }

  /** Removes every drop rule of the host. */
  async heal(name: string): Promise<void> {
    await nftScript(
      this.host(name).namespace,
      `flush chain inet ${TABLE} input\nflush chain inet ${TABLE} output\n`,
    );
  }

  /** Deletes the namespaces and the bridge (processes inside must be stopped first). Idempotent. */
  destroy(): void {
    if (this.destroyed) return;
    this.destroyed = true;
    ChaosNetwork.cleanLeftovers(this.tag);
  }

  private host(name: string): NetHost {
    const host = this.hosts.get(name);
    if (!host) throw new Error(`no namespace for ${name}`);
    return host;
  }
}
