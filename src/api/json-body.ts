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
 * with U+FFFD in its place and answered 201. Must run before routes are registered (a plugin
 * takes its parent's parsers when it is registered).
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
      parse(request, body.toString('utf8'), done);
    }
  });
}
