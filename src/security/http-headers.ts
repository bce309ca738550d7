// What a job may put into its target's headers. The API checks it when a job is saved (a 400
// naming the header) and the worker again before a call (a job stored before these checks must
// fail once, not every attempt until it is dead).

/**
 * Headers Helios or the HTTP client sets itself, or that change how the message is framed or the
 * connection is used (request smuggling, a hung `Expect: 100-continue`); a job may not set them.
 * `X-Helios-*` is reserved as a prefix.
 */
export const RESERVED_HEADERS: ReadonlySet<string> = new Set([
  'host',
  'content-length',
  'transfer-encoding',
  'connection',
  'keep-alive',
  'proxy-connection',
  'upgrade',
  'te',
  'trailer',
  'expect',
  'http2-settings',
  'idempotency-key',
]);

/** RFC 9110 token: the characters a field name may have. */
const TOKEN = /^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/;
/** Octets a field value may not have: controls other than tab, DEL, and anything past latin-1. */
const BAD_VALUE_CHAR = /[^\t\x20-\x7e\x80-\xff]/;

/** True for a header name a job may not set (any case). */
export function isReservedHeader(name: string): boolean {
  const lower = name.toLowerCase();
  return RESERVED_HEADERS.has(lower) || lower.startsWith('x-helios-');
}

/** Why `name: value` cannot be sent in an HTTP/1.1 request at all, or null when it can. */
export function headerProblem(name: string, value: string): string | null {
  if (!TOKEN.test(name)) return 'is not a valid header name';
  const bad = BAD_VALUE_CHAR.exec(value);
  if (bad) {
    const code = bad[0].codePointAt(0)!;
    const shown = `U+${code.toString(16).toUpperCase().padStart(4, '0')}`;
    return code > 0xff
      ? `has a character HTTP cannot carry (${shown}: values are latin-1; encode it, e.g. RFC 8187)`
      : `has a control character (${shown})`;
  }
  return null;
}
