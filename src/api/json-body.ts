import { isUtf8 } from 'node:buffer';
import type { FastifyInstance } from 'fastify';
import { badRequest, ProblemError } from './problems.js';

/** The `charset` parameter of a Content-Type header, quoted or not. */
const CHARSET = /;\s*charset\s*=\s*(?:"([^"]*)"|([^;\s]*))/i;

const UTF8 = new Set(['', 'utf-8', 'utf8']);

/**
 * Parses application/json bodies as Fastify does (prototype poisoning refused), but as UTF-8 only,
 * the encoding of JSON between systems (RFC 8259 §8.1). Fastify decoded the bytes with
 * replacement whatever the charset said: "café" sent in latin-1, or any invalid byte, was stored
 * with U+FFFD in its place and answered 201. A key that would set a prototype stays refused, as
 * a 400 naming where it is rather than as a syntax error. Must run before routes are registered
 * (a plugin takes its parent's parsers when it is registered).
 */
export function registerJsonParser(app: FastifyInstance): void {
  const parse = app.getDefaultJsonParser('error', 'error');
  app.removeContentTypeParser('application/json');
  app.addContentTypeParser('application/json', { parseAs: 'buffer' }, (request, body: Buffer, done) => {
    const match = CHARSET.exec(request.headers['content-type'] ?? '');
    if (!UTF8.has((match?.[1] ?? match?.[2] ?? '').toLowerCase())) {
      const message = 'charset must be utf-8, or left out';
      const problem = new ProblemError(415, 'unsupported-media-type', 'Unsupported media type', message, [
        { field: 'headers.content-type', message },
      ]);
      done(problem, undefined);
    } else if (!isUtf8(body)) {
      done(badRequest([{ field: 'body', message: 'is not valid UTF-8' }]), undefined);
    } else {
      const text = body.toString('utf8');
      parse(request, text, (error, value) => {
        if (error) {
          const field = (error as { code?: string }).code === INVALID_JSON ? poisonedKey(text) : null;
          if (field === null) done(error, value);
          else done(badRequest([{ field, message: 'is not allowed as a key: it would set a prototype' }]));
          return;
        }
        const field = changedNumber(text);
        if (field === null) done(null, value);
        else done(badRequest([{ field, message: NUMBER_CHANGED }]));
      });
    }
  });
}

const INVALID_JSON = 'FST_ERR_CTP_INVALID_JSON_BODY';

/**
 * Where in `text`, valid JSON that Fastify's parser refused, the key lies it refuses: `__proto__`,
 * or `constructor` holding `prototype` (prototype poisoning), as a field path. Null when `text`
 * is not JSON at all: then it is the syntax error it was said to be.
 */
function poisonedKey(text: string): string | null {
  let root: unknown;
  try {
    root = JSON.parse(text);
  } catch {
    return null;
  }
  return pathWhere(root, (value) => {
    if (value === null || typeof value !== 'object') return null;
    if (Object.hasOwn(value, '__proto__')) return ['__proto__'];
    const holder = Object.hasOwn(value, 'constructor')
      ? (value as Record<string, unknown>).constructor
      : undefined;
    const poisoned = typeof holder === 'object' && holder !== null && Object.hasOwn(holder, 'prototype');
    return poisoned ? ['constructor', 'prototype'] : null;
  });
}

const NUMBER_CHANGED =
  'has more digits than a JSON number keeps here (a double: about 15 significant digits, up to ±1.8e308); send it as a string';

/**
 * A literal only a double's rounding can change: 16 or more digits, or an exponent of three
 * digits (past ±1e308, or subnormal). Bodies without one skip the second parse.
 */
const MAY_ROUND = /\d[\d.]{15}|[eE][+-]?\d{3}/;

/** Stands in, during the second parse, for a number JSON.parse changed. */
const CHANGED = Object.freeze({});

type SourceReviver = (key: string, value: unknown, context?: { source?: string }) => unknown;

/**
 * Where in `text` (JSON that parsed) a number lies that JSON.parse rounded to another value
 * (12345678901234567890 is read as 12345678901234567000, 1e999 as Infinity): it would be
 * stored, shown and sent changed. A field path, or null when every number is kept as written.
 */
function changedNumber(text: string): string | null {
  if (!MAY_ROUND.test(text)) return null;
  const parse = JSON.parse as (text: string, reviver: SourceReviver) => unknown;
  let root: unknown;
  try {
    root = parse(text, (_key, value, context) => {
      if (typeof value !== 'number' || context?.source === undefined) return value;
      return decimalValue(context.source) === decimalValue(String(value)) ? value : CHANGED;
    });
  } catch {
    // A reviver recurses: nesting deep enough to overflow it is past every depth bound the
    // schema and the target body have, and refused there.
    return null;
  }
  return pathWhere(root, (value) => (value === CHANGED ? [] : null));
}

/**
 * A decimal literal's value as its significant digits and the power of ten before them
 * (`100`, `1e2` and `100.0` are all "1e3"; zero is "0" whatever its sign), to tell whether two
 * spellings are one number. Anything else (`Infinity`) is returned as it is.
 */
function decimalValue(literal: string): string {
  const match = /^(-?)(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?$/.exec(literal);
  if (!match) return literal;
  const [, sign = '', whole = '', fraction = '', exponent = '0'] = match;
  const digits = whole + fraction;
  const fromFirst = digits.replace(/^0+/, '');
  if (fromFirst === '') return '0';
  const point = whole.length - (digits.length - fromFirst.length) + Number(exponent);
  return `${sign}${fromFirst.replace(/0+$/, '')}e${point}`;
}

/**
 * Deepest node the walks below look at: deeper than anything a job stores (target.body nests at
 * most 32 levels, under `target.body`), which validation refuses anyway, and a field path of
 * thousands of keys would be a problem body of its own.
 */
const MAX_WALK_DEPTH = 40;

/**
 * The field path (dotted; `body` for the whole) of the first node, breadth first, for which
 * `suffix` names a problem, with the keys it returns appended; null when there is none within
 * {@link MAX_WALK_DEPTH}. Walked without recursion; a path is built only once found.
 */
function pathWhere(root: unknown, suffix: (value: unknown) => string[] | null): string | null {
  const nodes: { value: unknown; parent: number; key: string; depth: number }[] = [
    { value: root, parent: -1, key: '', depth: 0 },
  ];
  for (let index = 0; index < nodes.length; index++) {
    const { value, depth } = nodes[index]!;
    const found = suffix(value);
    if (found !== null) {
      const keys = found;
      for (let i = index; i > 0; i = nodes[i]!.parent) keys.unshift(nodes[i]!.key);
      return keys.length > 0 ? keys.join('.') : 'body';
    }
    if (value === null || typeof value !== 'object' || depth === MAX_WALK_DEPTH) continue;
    for (const [key, inner] of Object.entries(value)) {
      nodes.push({ value: inner, parent: index, key, depth: depth + 1 });
    }
  }
  return null;
}
