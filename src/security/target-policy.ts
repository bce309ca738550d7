import { lookup as dnsLookup, type LookupAddress } from 'node:dns';
import { isIP, type LookupFunction } from 'node:net';
import ipaddr from 'ipaddr.js';

// Pure outbound-safety policy for job targets. It lives outside api/ and execution/ so that both
// can use it: the API checks a target when it is saved, the worker again when it connects.

/**
 * Ranges refused by default: IPv4 link-local (169.254.169.254 is the metadata service of AWS,
 * GCP, Azure, OpenStack), IPv6 link-local, AWS's IPv6 metadata address, Alibaba Cloud's metadata
 * address, and the "this host" addresses 0.0.0.0/8 and :: (which reach loopback on Linux).
 */
export const DEFAULT_TARGET_DENY: readonly string[] = Object.freeze([
  '169.254.0.0/16',
  'fe80::/10',
  'fd00:ec2::254/128',
  '100.100.100.200/32',
  '0.0.0.0/8',
  '::/128',
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

type Address = ipaddr.IPv4 | ipaddr.IPv6;

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
 * not empty) some `allow` range does. Deny always wins. */
export interface TargetPolicy {
  readonly deny: readonly CidrRange[];
  /** Empty: every address not denied is allowed. */
  readonly allow: readonly CidrRange[];
}

/**
 * Builds a frozen policy.
 * @param options.deny CIDR ranges to refuse; default {@link DEFAULT_TARGET_DENY}.
 * @param options.allow CIDR ranges to allow exclusively; default none (all not denied).
 * @throws InvalidCidrError naming the bad entry.
 */
export function compileTargetPolicy(
  options: { deny?: readonly string[]; allow?: readonly string[] } = {},
): TargetPolicy {
  return Object.freeze({
    deny: Object.freeze((options.deny ?? DEFAULT_TARGET_DENY).map((c) => CidrRange.parse(c))),
    allow: Object.freeze((options.allow ?? []).map((c) => CidrRange.parse(c))),
  });
}

/** Why `address` (an IP literal) is refused, or null when it is allowed. */
export function deniedReason(address: string, policy: TargetPolicy): string | null {
  let ip: Address;
  try {
    // process() turns ::ffff:a.b.c.d into a.b.c.d, so mapped addresses cannot dodge IPv4 ranges.
    ip = ipaddr.process(address.replace(/%.*$/, ''));
  } catch {
    return `"${address}" is not an IP address`;
  }
  const shown = ip.toString();
  const denied = policy.deny.find((range) => range.contains(ip));
  if (denied) return `address ${shown} is in the denied range ${denied.text}`;
  if (policy.allow.length > 0 && !policy.allow.some((range) => range.contains(ip))) {
    return `address ${shown} is outside the allowed ranges`;
  }
  return null;
}

/** The IP literal a URL's hostname is, without IPv6 brackets; null for a DNS name. */
function literalAddress(hostname: string): string | null {
  const bare = hostname.startsWith('[') ? hostname.slice(1, -1) : hostname;
  return isIP(bare) === 0 ? null : bare;
}

/**
 * The checks that need no DNS, for when a target is saved: an absolute http(s) URL without
 * credentials whose host, if an IP literal, is allowed. Returns a message, or null when fine.
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
  return literal === null ? null : deniedReason(literal, policy);
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
  const hostname = new URL(text).hostname;
  const problem = checkTargetUrl(text, policy);
  if (problem) throw new TargetDeniedError(hostname, problem);
  const literal = literalAddress(hostname);
  if (literal !== null) return [{ address: literal, family: isIP(literal) }];
  const addresses = await resolve(hostname);
  if (addresses.length === 0) throw new TargetDeniedError(hostname, NO_ADDRESS);
  for (const { address } of addresses) {
    const reason = deniedReason(address, policy);
    if (reason) throw new TargetDeniedError(hostname, reason);
  }
  return addresses;
}

/**
 * A `lookup` for `net.connect`/`tls.connect` (undici: `new Agent({ connect: { lookup } })`) that
 * refuses a name when any of its addresses is denied, so the address checked is the address
 * connected to. Sockets skip `lookup` for IP literals: check those with {@link assertTargetAllowed}.
 */
export function guardedLookup(policy: TargetPolicy): LookupFunction {
  return (hostname, options, callback) => {
    dnsLookup(hostname, { ...options, all: true }, (err, addresses) => {
      if (err) return callback(err, '', 0);
      const denied = addresses.map((a) => deniedReason(a.address, policy)).find((r) => r !== null);
      if (denied) return callback(new TargetDeniedError(hostname, denied), '', 0);
      const first = addresses[0];
      if (!first) return callback(new TargetDeniedError(hostname, NO_ADDRESS), '', 0);
      if (options.all) return callback(null, addresses);
      return callback(null, first.address, first.family);
    });
  };
}
