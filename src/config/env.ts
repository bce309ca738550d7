// Parsing of single environment variables: each helper validates one variable and throws a
// ConfigError naming it, so a bad deployment fails at start with the variable to fix.

/** The environment a config is read from (`process.env`, or a plain object in tests). */
export type Env = Record<string, string | undefined>;

/** A setting from the environment is missing or invalid; the message names the variable. */
export class ConfigError extends Error {
  override name = 'ConfigError';
  constructor(
    readonly variable: string,
    message: string,
    options?: ErrorOptions,
  ) {
    super(`${variable}: ${message}`, options);
  }
}

/** A string; without a fallback the variable is required. */
export function str(env: Env, name: string, fallback?: string): string {
  const raw = env[name]?.trim();
  if (raw) return raw;
  if (fallback !== undefined) return fallback;
  throw new ConfigError(name, 'is required');
}

/** An optional string: undefined when unset or blank. */
export function optional(env: Env, name: string): string | undefined {
  return env[name]?.trim() || undefined;
}

/** An integer within [min, max]. */
export function int(env: Env, name: string, fallback: number, min: number, max: number): number {
  const raw = env[name]?.trim();
  if (!raw) return fallback;
  if (!/^-?\d+$/.test(raw)) throw new ConfigError(name, `must be an integer, got "${raw}"`);
  const value = Number(raw);
  if (value < min || value > max)
    throw new ConfigError(name, `must be between ${min} and ${max}, got ${value}`);
  return value;
}

const DURATION_UNITS: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 };

/** A duration: milliseconds, or a number with a unit (`500ms`, `90s`, `15m`, `12h`, `30d`). */
export function duration(env: Env, name: string, fallbackMs: number, minMs: number, maxMs: number): number {
  const raw = env[name]?.trim();
  if (!raw) return fallbackMs;
  const match = /^(\d+)(ms|s|m|h|d)?$/.exec(raw);
  if (!match)
    throw new ConfigError(name, `must be a duration like 30d, 12h, 15m, 90s or milliseconds, got "${raw}"`);
  const value = Number(match[1]) * DURATION_UNITS[match[2] ?? 'ms']!;
  if (value < minMs || value > maxMs)
    throw new ConfigError(name, `must be between ${minMs} ms and ${maxMs} ms, got ${value} ms`);
  return value;
}

/** `true`/`1`/`yes` or `false`/`0`/`no`, any case. */
export function bool(env: Env, name: string, fallback: boolean): boolean {
  const raw = env[name]?.trim().toLowerCase();
  if (!raw) return fallback;
  if (['true', '1', 'yes'].includes(raw)) return true;
  if (['false', '0', 'no'].includes(raw)) return false;
  throw new ConfigError(name, `must be true or false, got "${raw}"`);
}

/** One of a few words (lower-cased). */
export function oneOf<T extends string>(env: Env, name: string, choices: readonly T[], fallback: T): T {
  const raw = (env[name]?.trim() || fallback).toLowerCase();
  if (!choices.includes(raw as T)) {
    throw new ConfigError(name, `must be ${choices.join(' or ')}, got "${raw}"`);
  }
  return raw as T;
}

/** The items of a comma list, trimmed, blanks dropped; [] when unset. */
export function items(env: Env, name: string): string[] {
  return (env[name] ?? '')
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean);
}

/** A required comma list whose every item passes `check` (null, or the problem). */
export function list(env: Env, name: string, check: (item: string) => string | null): string[] {
  const values = items(env, name);
  if (values.length === 0) throw new ConfigError(name, 'is required');
  for (const item of values) {
    const problem = check(item);
    if (problem) throw new ConfigError(name, `${problem}: "${item}"`);
  }
  return values;
}

/** A check for `list`: a URL with one of these protocols (`'http:'`). */
export function checkUrl(protocols: string[]) {
  return (item: string): string | null => {
    try {
      const url = new URL(item);
      return protocols.includes(url.protocol) ? null : `protocol must be one of ${protocols.join(' ')}`;
    } catch {
      return 'is not a URL';
    }
  };
}

/** A check for `list`: `host:port` (an IPv6 address in brackets), the port within 1-65535. */
export function checkHostPort(item: string): string | null {
  const match = /^(?:\[([0-9A-Fa-f:.]*)\]|([A-Za-z0-9.-]*)):(\d{1,5})$/.exec(item);
  if (!match) return 'must be host:port (an IPv6 address in brackets)';
  if (!(match[1] ?? match[2])) return 'has no host';
  const port = Number(match[3]);
  return port >= 1 && port <= 65535 ? null : 'port must be between 1 and 65535';
}

/**
 * A name by Kafka's rules for topics: 1-249 of letters, digits, `.`, `_` and `-`, and not `.` or
 * `..` (a broker refuses any other topic, and only once the node tries to create it).
 */
export function kafkaName(env: Env, name: string, fallback: string): string {
  const value = str(env, name, fallback);
  if (!/^[A-Za-z0-9._-]{1,249}$/.test(value) || value === '.' || value === '..') {
    throw new ConfigError(
      name,
      `must be 1-249 letters, digits, ".", "_" or "-", and not "." or "..", got "${value}"`,
    );
  }
  return value;
}
