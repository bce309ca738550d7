import { STATUS_CODES, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import type { FastifyError, FastifyInstance, HTTPMethods } from 'fastify';
import type { Logger } from '../observability/logger.js';
import { badRequest, problemBody, ProblemError, toProblem } from './problems.js';
import { MAX_ID_LENGTH } from './schemas.js';

/**
 * Longest path parameter the router takes: IdParams' bound. Fastify's default of 100 refused a
 * job's name past 100 characters (names may have 128) on every /jobs/{id} route.
 */
export const MAX_PARAM_LENGTH = MAX_ID_LENGTH;

/** Stands in for an offending path segment while asking the router which parameter it is. */
const PLACEHOLDER = 'helios-path-placeholder';

/** A path segment decoded, or null when it is not valid percent-encoded UTF-8. */
const decoded = (segment: string): string | null => {
  try {
    return decodeURIComponent(segment);
  } catch {
    return null;
  }
};

/**
 * The name of the path parameter the segments `offending` picks out stand for, found by routing
 * the path with those segments replaced; `path` when they are not a route's parameter (an unknown
 * route, or a static part of one). Route shapes are no secret: /openapi.json is public.
 */
function parameterOf(
  app: FastifyInstance,
  method: string,
  url: string,
  offending: (segment: string) => boolean,
): string {
  const segments = url.split('?')[0]!.split('/');
  if (!segments.some(offending)) return 'path';
  const path = segments.map((s) => (offending(s) ? PLACEHOLDER : s)).join('/');
  const route = app.findRoute({ method: method as HTTPMethods, url: path });
  const name = Object.entries(route?.params ?? {}).find(([, value]) => value === PLACEHOLDER)?.[0];
  return name === undefined || name === '*' ? 'path' : name;
}

/**
 * The problem for an error Fastify's router raises before any hook or handler (the `frameworkErrors`
 * option): a path that is not valid percent-encoded UTF-8 (FST_ERR_BAD_URL), or a path parameter
 * longer than {@link MAX_PARAM_LENGTH} (FST_ERR_MAX_PARAM_LENGTH). Both are a 400 naming the path
 * parameter (e.g. `id`), or `path` when the route is unknown. Anything else as toProblem says.
 */
export function routerProblem(
  app: FastifyInstance,
  error: FastifyError,
  request: { method: string; url: string },
): ProblemError {
  const { method, url } = request;
  if (error.code === 'FST_ERR_BAD_URL') {
    const field = parameterOf(app, method, url, (s) => decoded(s) === null);
    return badRequest([{ field, message: 'is not valid percent-encoded UTF-8' }]);
  }
  if (error.code === 'FST_ERR_MAX_PARAM_LENGTH') {
    // The router measures a parameter decoded.
    const field = parameterOf(app, method, url, (s) => (decoded(s) ?? s).length > MAX_PARAM_LENGTH);
    const message =
      field === 'path'
        ? `has a segment longer than ${MAX_PARAM_LENGTH} characters`
        : `must NOT have more than ${MAX_PARAM_LENGTH} characters`;
    return badRequest([{ field, message }]);
  }
  return toProblem(error);
}

/** What Node's HTTP parser refused, by its error code: the answer's status and the field at fault. */
const PARSER_ERRORS: Record<string, { status: number; field?: string }> = {
  ERR_HTTP_REQUEST_TIMEOUT: { status: 408 },
  HPE_HEADER_OVERFLOW: { status: 431, field: 'headers' },
  HPE_INVALID_CONTENT_LENGTH: { status: 400, field: 'headers.content-length' },
  HPE_UNEXPECTED_CONTENT_LENGTH: { status: 400, field: 'headers.content-length' },
  HPE_INVALID_TRANSFER_ENCODING: { status: 400, field: 'headers.transfer-encoding' },
  HPE_INVALID_HEADER_TOKEN: { status: 400, field: 'headers' },
  HPE_INVALID_METHOD: { status: 400, field: 'method' },
  HPE_INVALID_URL: { status: 400, field: 'path' },
  HPE_INVALID_CHUNK_SIZE: { status: 400, field: 'body' },
  HPE_CHUNK_EXTENSIONS_OVERFLOW: { status: 400, field: 'body' },
};

const TITLES: Record<number, { slug: string; title: string }> = {
  400: { slug: 'bad-request', title: 'Bad request' },
  408: { slug: 'request-timeout', title: 'Request timeout' },
  431: { slug: 'headers-too-large', title: 'Request headers too large' },
};

/** The problem for a request Node's HTTP parser refused; it never reached Fastify. */
export function parserProblem(code: string | undefined): ProblemError {
  const { status, field } = PARSER_ERRORS[code ?? ''] ?? { status: 400, field: 'request' };
  const { slug, title } = TITLES[status]!;
  if (field === undefined)
    return new ProblemError(status, slug, title, 'the request took too long to arrive');
  const detail = `the HTTP request is malformed (${code ?? 'unknown'})`;
  return new ProblemError(status, slug, title, detail, [{ field, message: 'is malformed' }]);
}

/**
 * Fastify's `clientErrorHandler`: answers a request Node's HTTP parser refused (a bad
 * Content-Length, an invalid header, headers too large, too slow) with a problem, where Fastify's
 * default wrote plain JSON, then closes the connection as Fastify and Node do.
 */
export function clientErrorHandler(logger: Logger) {
  return (error: Error & { code?: string }, socket: Socket): void => {
    // A reset connection has nobody to answer.
    if (error.code === 'ECONNRESET' || socket.destroyed) return;
    // Not the error itself: it carries the bytes read so far (rawPacket), an Authorization
    // header and a job's secret headers among them.
    logger.trace(
      {
        code: error.code,
        reason: error.message,
        bytesParsed: (error as { bytesParsed?: number }).bytesParsed,
      },
      'client error',
    );
    // Node's own rule: no answer into a response already under way on this connection.
    const underway = (socket as { _httpMessage?: { headersSent?: boolean } })._httpMessage?.headersSent;
    if (socket.writable && !underway) writeProblem(socket, parserProblem(error.code));
    socket.destroy(error);
  };
}

/** Writes `problem` as a whole HTTP/1.1 answer straight to a socket HTTP has let go of. */
function writeProblem(socket: Duplex, problem: ProblemError): void {
  const body = JSON.stringify(problemBody(problem));
  socket.write(
    `HTTP/1.1 ${problem.status} ${STATUS_CODES[problem.status]}\r\n` +
      `Content-Type: application/problem+json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n` +
      `Connection: close\r\n\r\n${body}`,
  );
}

/**
 * Answers what Node's HTTP server settles itself, before Fastify sees a request, with problems
 * where Node wrote empty bodies or nothing: an Expect other than 100-continue (Node's own 417),
 * and CONNECT (Node drops the connection unanswered; this is no proxy). An HTTP/1.1 request
 * without Host is refused in an onRequest hook instead (buildApiServer turns Node's check off).
 */
export function answerNodeRefusals(server: Server): void {
  server.on('checkExpectation', (request: IncomingMessage, response: ServerResponse) => {
    const problem = new ProblemError(
      417,
      'expectation-failed',
      'Expectation failed',
      'only "Expect: 100-continue" is supported',
      [{ field: 'headers.expect', message: 'only 100-continue is supported' }],
    );
    const body = JSON.stringify(problemBody(problem, request.url?.split('?')[0]));
    response
      .writeHead(417, {
        'content-type': 'application/problem+json',
        'content-length': Buffer.byteLength(body),
        connection: 'close',
      })
      .end(body);
  });
  server.on('connect', (_request: IncomingMessage, socket: Duplex) => {
    socket.on('error', () => undefined); // a client gone before the answer is nobody's failure
    writeProblem(
      socket,
      badRequest([{ field: 'method', message: 'CONNECT is not served: this is no proxy' }]),
    );
    socket.end();
  });
}
