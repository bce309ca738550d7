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
        const field = (error as { code?: string } | null)?.code === INVALID_JSON ? poisonedKey(text) : null;
        if (field === null) done(error, value);
        else done(badRequest([{ field, message: 'is not allowed as a key: it would set a prototype' }]));
      });
    }
  });
}

const INVALID_JSON = 'FST_ERR_CTP_INVALID_JSON_BODY';

/**
 * Where in `text`, valid JSON that Fastify's parser refused, the key lies it refuses: `__proto__`,
 * or `constructor` holding `prototype` (prototype poisoning), as a dotted field path. Null when
 * `text` is not JSON at all: then it is the syntax error it was said to be.
 */
function poisonedKey(text: string): string | null {
  let root: unknown;
  try {
    root = JSON.parse(text);
  } catch {
    return null;
  }
  // Walked without recursion (a body may nest thousands deep); paths are built only when found.
  const nodes: { value: unknown; parent: number; key: string }[] = [{ value: root, parent: -1, key: '' }];
  const pathTo = (index: number, ...last: string[]) => {
    const keys = last;
    for (let i = index; i > 0; i = nodes[i]!.parent) keys.unshift(nodes[i]!.key);
    return keys.join('.');
  };
  for (let index = 0; index < nodes.length; index++) {
    const { value } = nodes[index]!;
    if (value === null || typeof value !== 'object') continue;
    if (Object.hasOwn(value, '__proto__')) return pathTo(index, '__proto__');
    const holder = Object.hasOwn(value, 'constructor')
      ? (value as Record<string, unknown>).constructor
      : undefined;
    if (typeof holder === 'object' && holder !== null && Object.hasOwn(holder, 'prototype')) {
      return pathTo(index, 'constructor', 'prototype');
    }
    for (const [key, inner] of Object.entries(value)) nodes.push({ value: inner, parent: index, key });
  }
  return null;
}
