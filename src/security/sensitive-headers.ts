/** What a sensitive header's value is shown as, in every response and log line. */
export const REDACTED = '***';

/** Header names whose values are always secret (lower case); HELIOS_SENSITIVE_HEADERS adds more. */
export const DEFAULT_SENSITIVE_HEADERS: readonly string[] = Object.freeze([
  'authorization',
  'cookie',
  'proxy-authorization',
  'x-api-key',
]);

/** Lower-cased set of the defaults plus `extra`. */
export function sensitiveHeaderSet(extra: readonly string[] = []): ReadonlySet<string> {
  return new Set([...DEFAULT_SENSITIVE_HEADERS, ...extra.map((h) => h.trim().toLowerCase())]);
}

/** A copy of `headers` with the value of every sensitive header (any case) replaced by `***`. */
export function redactHeaders(
  headers: Readonly<Record<string, string>>,
  sensitive: ReadonlySet<string>,
): Record<string, string> {
  const out: Record<string, string> = {};
  for (const [name, value] of Object.entries(headers)) {
    out[name] = sensitive.has(name.toLowerCase()) ? REDACTED : value;
  }
  return out;
}
