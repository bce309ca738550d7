import { lookup as dnsLookup, type LookupAddress } from 'node:dns';
import { isIP, type LookupFunction } from 'node:net';
import ipaddr from 'ipaddr.js';
import type { ClusterEndpoints } from './cluster-endpoints.js';

// Pure outbound-safety policy for job targets. It lives outside api/ and execution/ so that both
// can use it: the API checks a target when it is saved, the worker again when it connects.

/**
 * Ranges refused by default: IPv4 link-local (169.254.169.254 is the metadata service of AWS,
 * GCP, Azure, OpenStack), Azure's wire server 168.63.129.16, IPv6 link-local, AWS's IPv6 metadata
 * address, Alibaba Cloud's metadata address, and the "this host" addresses 0.0.0.0/8 and ::
 * (which reach loopback on Linux). They apply whatever HELIOS_TARGET_DENY adds, unless
 * HELIOS_TARGET_DENY_DEFAULTS=false turns them off.
 */
export const DEFAULT_TARGET_DENY: readonly string[] = Object.freeze([
  '169.254.0.0/16',
  '168.63.129.16/32',
  'fe80::/10',
  'fd00:ec2::254/128',
  '100.100.100.200/32',
  '0.0.0.0/8',
  '::/128',
]);

/**
 * Ranges HELIOS_TARGET_POLICY=strict refuses on top of the defaults: loopback, the private and
 * shared (carrier-grade NAT) ranges, benchmarking, IPv6 unique-local and site-local, multicast
 * and broadcast: what is left is the public internet. HELIOS_TARGET_ALLOW cannot re-open them
 * (deny wins).
 */
export const STRICT_TARGET_DENY: readonly string[] = Object.freeze([
  '127.0.0.0/8',
  '::1/128',
  '10.0.0.0/8',
  '172.16.0.0/12',
  '192.168.0.0/16',
  '100.64.0.0/10',
  '198.18.0.0/15',
  '192.0.0.0/24',
  'fc00::/7',
  'fec0::/10',
  '224.0.0.0/4',
  '240.0.0.0/4',
  'ff00::/8',
]);

/** A CIDR (or single address) in a deny or allow list could not be parsed. */
export class InvalidCidrError extends Error {
  override name = 'InvalidCidrError';
}

/** Why a name that resolves to nothing is refused (a DNS condition, unlike a denied address). */
export const NO_ADDRESS = 'it resolved to no address';

/** An address or URL was refused by the target policy; `reason` is safe to show to users. */
export class TargetDeniedError extends Error {
  override name = 'TargetDeniedError';
  readonly code = 'HELIOS_TARGET_DENIED';
  constructor(
    readonly hostname: string,
    readonly reason: string,
  ) {
    super(`target host ${hostname} refused: ${reason}`);
  }

  /** True when the policy itself refused (a denied address): asking again gives the same answer. */
  get permanent(): boolean {
    return this.reason !== NO_ADDRESS;
  }
}

export type Address = ipaddr.IPv4 | ipaddr.IPv6;

/** One IPv4 or IPv6 range; IPv4-mapped IPv6 addresses are compared as IPv4. */
export class CidrRange {
  private constructor(
    readonly text: string,
    private readonly network: Address,
    private readonly bits: number,
  ) {}

  /** Parses `a.b.c.d/n`, `x::y/n`, or a single address (a /32 or /128). */
  static parse(text: string): CidrRange {
    const trimmed = text.trim();
    const [address = '', bits] = trimmed.split('/');
    if (isIP(address) === 0 || (bits !== undefined && !/^\d{1,3}$/.test(bits))) {
      throw new InvalidCidrError(`"${trimmed}" is not an IP address or CIDR range`);
    }
    try {
      if (bits === undefined) {
        const ip = ipaddr.parse(address);
        return new CidrRange(trimmed, ip, ip.kind() === 'ipv4' ? 32 : 128);
      }
      const [network, prefix] = ipaddr.parseCIDR(trimmed);
      return new CidrRange(trimmed, network, prefix);
    } catch (err) {
      throw new InvalidCidrError(`"${trimmed}" is not a valid CIDR range`, { cause: err });
    }
  }

  contains(address: Address): boolean {
    return address.kind() === this.network.kind() && address.match(this.network, this.bits);
  }
}

/** The compiled policy: an address is allowed if no `deny` range holds it and (when `allow` is
 * not empty) some `allow` range does. Deny always wins, and the cluster's own endpoints are
 * always refused. */
export interface TargetPolicy {
  readonly deny: readonly CidrRange[];
  /** Empty: every address not denied is allowed. */
  readonly allow: readonly CidrRange[];
  /** The cluster's own servers (etcd, Kafka, PostgreSQL, node APIs), refused on their ports. */
  readonly cluster?: ClusterEndpoints;
}

/** Options of {@link compileTargetPolicy}. */
export interface TargetPolicyOptions {
  /** CIDR ranges refused in addition to the defaults; default none. */
  readonly deny?: readonly string[];
  /** CIDR ranges allowed exclusively; default none (every address not denied). */
  readonly allow?: readonly string[];
  /** Refuse {@link DEFAULT_TARGET_DENY}; default true. */
  readonly defaults?: boolean;
  /** Also refuse {@link STRICT_TARGET_DENY} (loopback and private ranges); default false. */
  readonly strict?: boolean;
  /** The cluster's own endpoints; default none. */
  readonly cluster?: ClusterEndpoints;
}

/**
 * Builds a frozen policy. `deny` adds to the defaults: an operator who adds `10.0.0.0/8` must not
 * re-open the metadata service by doing so.
 * @throws InvalidCidrError naming the bad entry.
 */
export function compileTargetPolicy(options: TargetPolicyOptions = {}): TargetPolicy {
  const deny = [
    ...(options.defaults === false ? [] : DEFAULT_TARGET_DENY),
    ...(options.strict ? STRICT_TARGET_DENY : []),
    ...(options.deny ?? []),
  ];
  return Object.freeze({
    deny: Object.freeze(deny.map((c) => CidrRange.parse(c))),
    allow: Object.freeze((options.allow ?? []).map((c) => CidrRange.parse(c))),
    ...(options.cluster ? { cluster: options.cluster } : {}),
  });
}

/** The same policy, also refusing `cluster`'s endpoints. */
export function withClusterEndpoints(policy: TargetPolicy, cluster: ClusterEndpoints): TargetPolicy {
  return Object.freeze({ ...policy, cluster });
}

const part = (ip: ipaddr.IPv6, i: number) => ip.parts[i]!;
const v4 = (high: number, low: number) => new ipaddr.IPv4([high >> 8, high & 0xff, low >> 8, low & 0xff]);

/**
 * The IPv4 address an IPv6 transition form carries, which is where a packet to it may end up:
 * NAT64 `64:ff9b::/96` (RFC 6052), 6to4 `2002::/16`, Teredo `2001::/32` (its client, stored
 * inverted) and IPv4-compatible `::a.b.c.d` (but not `::` and `::1`). IPv4-mapped addresses are
 * already turned into IPv4 by ipaddr.process.
 */
export function embeddedIPv4(ip: Address): ipaddr.IPv4 | null {
  if (ip.kind() !== 'ipv6') return null;
  const v6 = ip as ipaddr.IPv6;
  const zeros = (from: number, to: number) => v6.parts.slice(from, to).every((p) => p === 0);
  if (part(v6, 0) === 0x64 && part(v6, 1) === 0xff9b && zeros(2, 6)) return v4(part(v6, 6), part(v6, 7));
  if (part(v6, 0) === 0x2002) return v4(part(v6, 1), part(v6, 2));
  if (part(v6, 0) === 0x2001 && part(v6, 1) === 0) return v4(~part(v6, 6) & 0xffff, ~part(v6, 7) & 0xffff);
  if (zeros(0, 6) && (part(v6, 6) !== 0 || part(v6, 7) > 1)) return v4(part(v6, 6), part(v6, 7));
  return null;
}

/**
 * Why `address` (an IP literal) is refused, or null when it is allowed. With `port`, the
 * cluster's own endpoints are checked too (they are refused on their port only, so that a
 * demo target on loopback stays reachable in the permissive policy).
 */
export function deniedReason(address: string, policy: TargetPolicy, port?: number): string | null {
  let ip: Address;
  try {
    // process() turns ::ffff:a.b.c.d into a.b.c.d, so mapped addresses cannot dodge IPv4 ranges.
    ip = ipaddr.process(address.replace(/%.*$/, ''));
  } catch {
    return `"${address}" is not an IP address`;
  }
  const shown = ip.toString();
  // A transition form is checked as itself and as the IPv4 address it reaches.
  const forms: Address[] = [ip];
  const inner = embeddedIPv4(ip);
  if (inner) forms.push(inner);
  for (const form of forms) {
    const denied = policy.deny.find((range) => range.contains(form));
    if (denied) {
      const via = form === ip ? '' : ` (it embeds ${form.toString()})`;
      return `address ${shown}${via} is in the denied range ${denied.text}`;
    }
    const own = port === undefined ? null : (policy.cluster?.match(form, port) ?? null);
    if (own) return `address ${shown} port ${port} is the cluster's own ${own}`;
  }
  if (policy.allow.length > 0 && !policy.allow.some((range) => forms.some((f) => range.contains(f)))) {
    return `address ${shown} is outside the allowed ranges`;
  }
  return null;
}

/** The port a parsed http(s) URL connects to. */
export function portOf(url: URL): number {
  return url.port ? Number(url.port) : url.protocol === 'https:' ? 443 : 80;
}

/** The IP literal a URL's hostname is, without IPv6 brackets; null for a DNS name. */
function literalAddress(hostname: string): string | null {
  const bare = hostname.startsWith('[') ? hostname.slice(1, -1) : hostname;
  return isIP(bare) === 0 ? null : bare;
}

/**
 * The checks that need no DNS, for when a target is saved: an absolute http(s) URL without
 * credentials whose host, if an IP literal, is allowed, and is not one of the cluster's own
 * servers by name (on its port). Returns a message, or null when fine.
 * (WHATWG URL parsing already turns `http://2852039166/` and `0xA9FEA9FE` into dotted form.)
 */
export function checkTargetUrl(url: string, policy: TargetPolicy): string | null {
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    return 'must be an absolute URL';
  }
  if (parsed.protocol !== 'http:' && parsed.protocol !== 'https:') return 'must use http or https';
  // Credentials in the URL would be shown back in every response; headers are redacted instead.
  if (parsed.username || parsed.password) return 'must not contain credentials (use target.headers)';
  if (!parsed.hostname) return 'must have a host';
  const literal = literalAddress(parsed.hostname);
  if (literal !== null) return deniedReason(literal, policy, portOf(parsed));
  const own = policy.cluster?.matchName(parsed.hostname, portOf(parsed)) ?? null;
  return own === null ? null : `host ${parsed.hostname} port ${portOf(parsed)} is the cluster's own ${own}`;
}

/** Resolves a hostname to every address it has. */
export type Resolver = (hostname: string) => Promise<LookupAddress[]>;

const systemResolver: Resolver = (hostname) =>
  new Promise((resolve, reject) => {
    dnsLookup(hostname, { all: true, verbatim: true }, (err, addresses) =>
      err ? reject(err) : resolve(addresses),
    );
  });

/**
 * The execution-time check: resolves the URL's host (unless it is an IP literal) and refuses it
 * if any of its addresses is denied. Returns the checked addresses.
 * A name can resolve differently a moment later (DNS rebinding), so a worker should also connect
 * through {@link guardedLookup}, which applies the same check to the lookup the socket really uses.
 * @param resolve how names are resolved; default the system resolver (`dns.lookup`, all addresses).
 * @throws TargetDeniedError, or the resolver's error when the name does not resolve.
 */
export async function assertTargetAllowed(
  url: string | URL,
  policy: TargetPolicy,
  resolve: Resolver = systemResolver,
): Promise<LookupAddress[]> {
  const text = url.toString();
  const parsed = new URL(text);
  const hostname = parsed.hostname;
  const problem = checkTargetUrl(text, policy);
  if (problem) throw new TargetDeniedError(hostname, problem);
  const literal = literalAddress(hostname);
  if (literal !== null) return [{ address: literal, family: isIP(literal) }];
  const addresses = await resolve(hostname);
  if (addresses.length === 0) throw new TargetDeniedError(hostname, NO_ADDRESS);
  for (const { address } of addresses) {
    const reason = deniedReason(address, policy, portOf(parsed));
    if (reason) throw new TargetDeniedError(hostname, reason);
  }
  return addresses;
}

/**
 * A `lookup` for `net.connect`/`tls.connect` (undici: `new Agent({ connect: { lookup } })`) that
 * refuses a name when any of its addresses is denied, so the address checked is the address
 * connected to. Sockets skip `lookup` for IP literals: check those with {@link assertTargetAllowed}.
 * A lookup does not learn the port: give it `port` (one lookup per origin) so that the cluster's
 * own endpoints are refused too.
 */
export function guardedLookup(policy: TargetPolicy, port?: number): LookupFunction {
  return (hostname, options, callback) => {
    dnsLookup(hostname, { ...options, all: true }, (err, addresses) => {
      if (err) return callback(err, '', 0);
      const denied = addresses.map((a) => deniedReason(a.address, policy, port)).find((r) => r !== null);
      if (denied) return callback(new TargetDeniedError(hostname, denied), '', 0);
      const first = addresses[0];
      if (!first) return callback(new TargetDeniedError(hostname, NO_ADDRESS), '', 0);
      if (options.all) return callback(null, addresses);
      return callback(null, first.address, first.family);
    });
  };
}
