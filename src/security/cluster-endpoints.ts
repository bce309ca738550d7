import { lookup as dnsLookup } from 'node:dns';
import { isIP } from 'node:net';
import { networkInterfaces } from 'node:os';
import ipaddr from 'ipaddr.js';

// The cluster's own servers as job targets are the worst SSRF there is: a POST to etcd's gateway
// can rewrite the leader key, a GET can read the keyspace back through the response excerpt. So
// the configured etcd, Kafka and PostgreSQL endpoints, every etcd member (client and peer URLs),
// Kafka broker and KRaft controller listener the running cluster lists, and every node's API are
// refused on their ports, compared after DNS like every other check of the target policy.

type Address = ipaddr.IPv4 | ipaddr.IPv6;

/** One server of the cluster: a host (name or IP literal) and a port. */
export interface Endpoint {
  readonly host: string;
  readonly port: number;
  /** What it is, shown in the refusal: `etcd`, `Kafka broker`, `Kafka controller`, `PostgreSQL`, …. */
  readonly what: string;
}

/** Resolves a host name to its addresses (default `dns.lookup`, every address). */
export type HostResolver = (host: string) => Promise<string[]>;

const systemResolver: HostResolver = (host) =>
  new Promise((resolve, reject) => {
    dnsLookup(host, { all: true, verbatim: true }, (err, addresses) =>
      err ? reject(err) : resolve(addresses.map((a) => a.address)),
    );
  });

const bare = (host: string) => host.replace(/^\[(.*)\]$/, '$1');
const parse = (address: string): Address => ipaddr.process(bare(address).replace(/%.*$/, ''));

/** The endpoint of a URL (`http://h:2379`, a node's apiUrl); null when it has no usable host. */
export function endpointOfUrl(url: string, what: string, defaultPort?: number): Endpoint | null {
  try {
    const parsed = new URL(url);
    if (!parsed.hostname) return null;
    const port = parsed.port
      ? Number(parsed.port)
      : (defaultPort ?? (parsed.protocol === 'https:' ? 443 : 80));
    return { host: bare(parsed.hostname), port, what };
  } catch {
    return null;
  }
}

/** What pg falls back to when a connection string names no host or port: PGHOST and PGPORT. */
export interface DatabaseDefaults {
  readonly host?: string | undefined;
  readonly port?: string | undefined;
}

/**
 * The endpoints pg connects to for a PostgreSQL connection string, including the multi-host form
 * `postgres://h1:5432,h2:5433/db` (which URL cannot parse); a socket directory has none. pg takes
 * `?host=` and `?port=` from the query over the authority (the last of each), then PGHOST and
 * PGPORT (`defaults`), then localhost:5432: `postgres:///helios?port=5433` is localhost:5433. The
 * hosts follow the authority's last `@`, as pg (and WHATWG URL) read it: a password may hold an
 * unencoded `@`, which pg accepts.
 */
export function endpointsOfDatabaseUrl(url: string, defaults: DatabaseDefaults = {}): Endpoint[] {
  const [, authority = '', rest = ''] = /^postgres(?:ql)?:\/\/([^/?#]*)([^#]*)/i.exec(url) ?? [];
  const query = new URLSearchParams(rest.includes('?') ? rest.slice(rest.indexOf('?') + 1) : '');
  const queryHost = query.getAll('host').at(-1);
  const queryPort = query.getAll('port').at(-1);
  const written = authority
    .slice(authority.lastIndexOf('@') + 1)
    .split(',')
    .filter(Boolean)
    .flatMap((hostPort) => {
      const match = /^(\[[^\]]+\]|[^:]*)(?::(\d+))?$/.exec(decodeURIComponent(hostPort));
      return match ? [{ host: match[1] ?? '', port: match[2] }] : [];
    });
  return (written.length > 0 ? written : [{ host: '', port: undefined }]).flatMap((server) => {
    // Empty values fall through, as in pg: `?host=` is no host.
    const host = queryHost || server.host || defaults.host || 'localhost';
    const port = Number.parseInt(queryPort || server.port || defaults.port || '5432', 10);
    if (host.startsWith('/') || !(port > 0 && port < 65536)) return [];
    return [{ host: bare(host), port, what: 'PostgreSQL' }];
  });
}

/** The endpoint of a `host:port` Kafka broker address. */
export function endpointOfHostPort(hostPort: string, what: string): Endpoint | null {
  const match = /^(\[[^\]]+\]|[^:]+):(\d{1,5})$/.exec(hostPort.trim());
  return match ? { host: bare(match[1]!), port: Number(match[2]), what } : null;
}

/** Every member's client and peer URLs, from etcd's member list. */
export function endpointsOfEtcdMembers(
  members: readonly { readonly clientURLs: readonly string[]; readonly peerURLs: readonly string[] }[],
): Endpoint[] {
  return members.flatMap((m) => [
    ...m.clientURLs.flatMap((url) => endpointOfUrl(url, 'etcd', 2379) ?? []),
    ...m.peerURLs.flatMap((url) => endpointOfUrl(url, 'etcd peer', 2380) ?? []),
  ]);
}

/** The cluster's own servers as configured: never valid job targets. */
export function configuredEndpoints(
  etcdEndpoints: readonly string[],
  kafkaBrokers: readonly string[],
  databaseUrl: string,
  api: { host: string; port: number; publicUrl: string | undefined },
  /** PGHOST and PGPORT, which pg reads for what the connection string leaves out. */
  databaseDefaults: DatabaseDefaults = {},
): Endpoint[] {
  const endpoints: (Endpoint | null)[] = [
    // etcd3 gives gRPC the endpoint without its scheme: gRPC dials 443 when it has no port.
    ...etcdEndpoints.map((url) => endpointOfUrl(url, 'etcd', 443)),
    ...kafkaBrokers.map((broker) => endpointOfHostPort(broker, 'Kafka broker')),
    ...endpointsOfDatabaseUrl(databaseUrl, databaseDefaults),
    // Port 0 is only known once bound: the node adds its address then.
    api.port === 0 ? null : { host: api.host, port: api.port, what: 'node API' },
    api.publicUrl ? endpointOfUrl(api.publicUrl, 'node API') : null,
  ];
  return endpoints.filter((e): e is Endpoint => e !== null);
}

interface ResolvedEndpoint {
  readonly addresses: readonly Address[];
  /** True when the server is on this host: every address of this host reaches it then. */
  readonly local: boolean;
  readonly port: number;
  readonly what: string;
}

/** Addresses that reach this host: loopback, "this host", and every interface's address. */
function localAddresses(): Address[] {
  const own = Object.values(networkInterfaces())
    .flat()
    .flatMap((i) => (i ? [i.address] : []));
  return own.flatMap((a) => {
    try {
      return [parse(a)];
    } catch {
      return [];
    }
  });
}

const isLocal = (ip: Address, local: readonly Address[]) => {
  const range = ip.range();
  return (
    range === 'loopback' ||
    range === 'unspecified' ||
    local.some((l) => l.kind() === ip.kind() && l.toString() === ip.toString())
  );
};

/** A host name as DNS compares it: any case, the root's trailing dot or not. */
const normalName = (name: string) => name.toLowerCase().replace(/\.$/, '');

/** How long the last good answer of a name no longer among the endpoints is kept. */
const FORGET_UNLISTED_MS = 3_600_000;

/**
 * The cluster's endpoints, resolved. {@link match} is synchronous (it runs inside a socket's
 * lookup); {@link refresh} re-resolves names, keeping the last good answer of a name that fails.
 * Endpoints given as IP literals are in force from construction; names are, as names, from
 * construction ({@link matchName}) and, by their addresses, after the first refresh.
 */
export class ClusterEndpoints {
  private fixed: readonly Endpoint[];
  /** Learnt while running, by source (the node registry, etcd's members, Kafka's brokers). */
  private readonly discovered = new Map<string, readonly Endpoint[]>();
  private resolved: readonly ResolvedEndpoint[] = [];
  /** `name:port` of every endpoint given by name (see matchName), to what it is. */
  private named = new Map<string, string>();
  /** Each name's last good answer, and when the name was last among the endpoints (see refresh). */
  private readonly lastGood = new Map<string, { addresses: readonly Address[]; listedAt: number }>();
  private local: readonly Address[] = localAddresses();
  /** Grows whenever the set changes, so a cache of verdicts knows to start over. */
  generation = 0;

  constructor(
    endpoints: readonly Endpoint[],
    private readonly resolve: HostResolver = systemResolver,
    /** A monotonic clock, ms (default performance.now). */
    private readonly now: () => number = () => performance.now(),
  ) {
    this.fixed = [...endpoints];
    this.resolved = this.compile();
  }

  /** Adds endpoints that are not known at start (this node's API once its port is bound). */
  add(endpoints: readonly Endpoint[]): void {
    this.fixed = [...this.fixed, ...endpoints];
    this.resolved = this.compile();
    this.generation += 1;
  }

  /**
   * Replaces the endpoints learnt from `source` (node.ts: `nodes`, every node's apiUrl; `etcd
   * members`, every member's client and peer URLs; `kafka brokers`, every broker the cluster's
   * metadata lists; `kafka controllers`, every controller listener the quorum lists). A source that
   * cannot be read is not set again: its last answer stays.
   */
  setDiscovered(source: string, endpoints: readonly Endpoint[]): void {
    this.discovered.set(source, [...endpoints]);
    this.resolved = this.compile();
    this.generation += 1;
  }

  /** Every endpoint, as configured and as learnt. */
  list(): readonly Endpoint[] {
    return [...this.fixed, ...[...this.discovered.values()].flat()];
  }

  /** Resolves every name again (bounded by `timeoutMs` each); never throws. */
  async refresh(timeoutMs = 2000): Promise<void> {
    const names = [...new Set(this.list().map((e) => e.host))].filter((h) => isIP(h) === 0);
    const now = this.now();
    for (const name of names) {
      const known = this.lastGood.get(name);
      if (known) known.listedAt = now;
    }
    // A node bound to 0.0.0.0 registers its hostname, and a pod gets a new one at every restart:
    // answers kept for every name ever listed would grow with the cluster's restarts, for months.
    // A name gone for an hour is forgotten; one that left a moment ago keeps its answer, so it is
    // still refused if it comes back while DNS fails.
    for (const [name, known] of this.lastGood) {
      if (now - known.listedAt > FORGET_UNLISTED_MS) this.lastGood.delete(name);
    }
    await Promise.all(
      names.map(async (name) => {
        let timer: NodeJS.Timeout | undefined;
        try {
          const addresses = await Promise.race([
            this.resolve(name),
            new Promise<never>((_resolve, reject) => {
              timer = setTimeout(() => reject(new Error('timeout')), timeoutMs);
            }),
          ]);
          this.lastGood.set(name, { addresses: addresses.map(parse), listedAt: now });
        } catch {
          // Keep the last good answer: a DNS hiccup must not open the cluster's ports.
        } finally {
          clearTimeout(timer);
        }
      }),
    );
    this.local = localAddresses();
    this.resolved = this.compile();
    this.generation += 1;
  }

  /** What `ip:port` is when it is one of the cluster's servers (`etcd`, …), else null. */
  match(ip: Address, port: number): string | null {
    for (const endpoint of this.resolved) {
      if (endpoint.port !== port) continue;
      if (endpoint.local && isLocal(ip, this.local)) return endpoint.what;
      if (endpoint.addresses.some((a) => a.kind() === ip.kind() && a.toString() === ip.toString())) {
        return endpoint.what;
      }
    }
    return null;
  }

  /**
   * What `name:port` is when one of the cluster's servers is given by that name (`etcd`, …), else
   * null. A name is refused on its port wherever it points: when a server moves, the name points to
   * the new address before the next {@link refresh} learns it.
   */
  matchName(name: string, port: number): string | null {
    return this.named.get(`${normalName(name)}:${port}`) ?? null;
  }

  private compile(): ResolvedEndpoint[] {
    this.named = new Map(
      this.list()
        .filter((e) => isIP(e.host) === 0)
        .map((e) => [`${normalName(e.host)}:${e.port}`, e.what]),
    );
    return this.list().map((endpoint) => {
      let addresses: readonly Address[];
      if (isIP(endpoint.host) !== 0) addresses = [parse(endpoint.host)];
      else if (endpoint.host.toLowerCase() === 'localhost') addresses = [parse('127.0.0.1'), parse('::1')];
      else addresses = this.lastGood.get(endpoint.host)?.addresses ?? [];
      return {
        addresses,
        local: addresses.some((a) => isLocal(a, this.local)),
        port: endpoint.port,
        what: endpoint.what,
      };
    });
  }
}
