import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify';
import type { Logger } from '../observability/logger.js';
import { toError } from '../errors.js';
import { JobDeleteInterruptedError } from '../jobs/commands.js';
import { isDatabaseOutage } from '../store/db.js';
import { DuplicateJobNameError } from '../store/jobs.js';

/** What a 503 for a database outage asks the caller to wait before trying again, in seconds. */
const DATABASE_RETRY_AFTER_S = 2;

/** One failing input field; `field` is a dotted path such as `target.url` or `limit`. */
export interface FieldError {
  readonly field: string;
  readonly message: string;
}

/** An RFC 9457 problem details body, as every API error is sent (`application/problem+json`). */
export interface ProblemBody {
  type: string;
  title: string;
  status: number;
  detail?: string;
  instance?: string;
  errors?: FieldError[];
}

/** An error that becomes a problem response with its own status, title and field errors. */
export class ProblemError extends Error {
  override name = 'ProblemError';
  constructor(
    readonly status: number,
    readonly slug: string,
    readonly title: string,
    readonly detail?: string,
    readonly errors?: FieldError[],
    readonly headers: Record<string, string> = {},
  ) {
    super(detail ?? title);
  }
}

export const badRequest = (errors: FieldError[], detail?: string) =>
  new ProblemError(400, 'validation', 'Invalid request', detail ?? errors[0]?.message, errors);
export const notFound = (what: string) =>
  new ProblemError(404, 'not-found', 'Not found', `${what} not found`);
export const conflict = (field: string, message: string) =>
  new ProblemError(409, 'conflict', 'Conflict', message, [{ field, message }]);

/** Turns a TypeBox/JSON-pointer path into a dotted field name (`/target/url` → `target.url`). */
export function fieldOf(path: string, part: string): string {
  const trimmed = path.replace(/^\//, '');
  if (trimmed === '') return part === 'body' ? 'body' : part;
  return trimmed
    .split('/')
    .map((s) => s.replaceAll('~1', '/').replaceAll('~0', '~'))
    .join('.');
}

interface ValidationIssue {
  instancePath?: string;
  message?: string;
}

/**
 * Fastify's own errors before a handler runs (content type, body size, JSON syntax), and the
 * field each is about (default `body`).
 */
const FASTIFY_ERRORS: Record<string, { status: number; slug: string; title: string; field?: string }> = {
  FST_ERR_CTP_BODY_TOO_LARGE: { status: 413, slug: 'body-too-large', title: 'Request body too large' },
  FST_ERR_CTP_INVALID_MEDIA_TYPE: {
    status: 415,
    slug: 'unsupported-media-type',
    title: 'Unsupported media type',
  },
  FST_ERR_CTP_EMPTY_JSON_BODY: { status: 400, slug: 'validation', title: 'Invalid request' },
  FST_ERR_CTP_INVALID_JSON_BODY: { status: 400, slug: 'malformed-json', title: 'Malformed JSON' },
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: { status: 400, slug: 'validation', title: 'Invalid request' },
  // A QUERY request (RFC 10008) must say what its content is; refused before routing, on any path.
  FST_ERR_ROUTE_MISSING_CONTENT_TYPE: {
    status: 400,
    slug: 'validation',
    title: 'Invalid request',
    field: 'headers.content-type',
  },
};

/** Maps anything thrown while serving a request to a problem; unknown errors are a 500. */
export function toProblem(error: unknown): ProblemError {
  if (error instanceof ProblemError) return error;
  if (error instanceof DuplicateJobNameError) return conflict('name', error.message);
  if (error instanceof JobDeleteInterruptedError) {
    // Answered as what stopped it, saying what had been written (its statements are its own).
    const cause = toProblem(error.cause);
    const detail = `${error.message}; the job and its other runs are as they were: send the delete again to finish it`;
    return new ProblemError(cause.status, cause.slug, cause.title, detail, cause.errors, cause.headers);
  }
  const e = error as Partial<FastifyError> & { validation?: ValidationIssue[]; code?: string };
  if (Array.isArray(e.validation)) {
    const part = e.validationContext ?? 'body';
    const seen = new Set<string>();
    const errors: FieldError[] = [];
    for (const issue of e.validation) {
      const field = fieldOf(issue.instancePath ?? '', part);
      if (seen.has(field)) continue;
      seen.add(field);
      errors.push({ field, message: issue.message ?? 'is invalid' });
    }
    return badRequest(errors);
  }
  const known = e.code ? FASTIFY_ERRORS[e.code] : undefined;
  if (known) {
    // A JSON syntax error's message quotes the input; it is only a fragment, but never echo input.
    const detail = known.slug === 'malformed-json' ? 'the body is not valid JSON' : e.message;
    return new ProblemError(known.status, known.slug, known.title, detail, [
      { field: known.field ?? 'body', message: detail ?? known.title },
    ]);
  }
  // Other client errors Fastify raises before routing.
  if (typeof e.statusCode === 'number' && e.statusCode >= 400 && e.statusCode < 500) {
    return new ProblemError(e.statusCode, 'bad-request', 'Bad request', 'the request was rejected', [
      { field: 'body', message: 'the request was rejected' },
    ]);
  }
  // PostgreSQL data exceptions (class 22) mean input got past validation: still the client's.
  if (typeof e.code === 'string' && /^22[0-9A-Z]{3}$/.test(e.code)) {
    return badRequest([{ field: 'body', message: 'a value is not acceptable to the database' }]);
  }
  // Two writes met in opposite lock order (deadlock), a serialization failure, or a command that
  // kept yielding to workers holding its rows (55P03, lockYielding in store/jobs.ts): PostgreSQL
  // rolled this one back whole, so nothing is half-written and the caller may simply try again.
  if (e.code === '40P01' || e.code === '40001' || e.code === '55P03') {
    return new ProblemError(
      409,
      'concurrent-change',
      'Conflict',
      'a concurrent change got in the way; nothing was written, try again',
    );
  }
  // PostgreSQL could not be reached, or did not answer within its statement_timeout: the request
  // is all-or-nothing (a transaction), and the caller may try it again shortly.
  if (isDatabaseOutage(e)) {
    return new ProblemError(
      503,
      'database-unavailable',
      'Service unavailable',
      'the database could not be reached or did not answer in time; try again (a write is all or nothing)',
      undefined,
      { 'retry-after': String(DATABASE_RETRY_AFTER_S) },
    );
  }
  return new ProblemError(500, 'internal', 'Internal server error', 'the server failed; see its log');
}

/** Sends `problem` as application/problem+json; logs 5xx errors (never the request body). */
export function sendProblem(
  reply: FastifyReply,
  request: FastifyRequest,
  error: unknown,
  logger: Logger,
): FastifyReply {
  const problem = toProblem(error);
  if (problem.status >= 500) {
    // A database outage is logged by every request it fails, so it is a warning: the node's own
    // loops report the outage itself.
    logger[problem.slug === 'database-unavailable' ? 'warn' : 'error'](
      { err: toError(error), method: request.method, route: request.routeOptions.url },
      'request failed',
    );
  }
  const body = problemBody(problem, request.url.split('?')[0]);
  return reply.code(problem.status).headers(problem.headers).type('application/problem+json').send(body);
}

/** The RFC 9457 body of `problem`; `instance` is the request's path when there is one. */
export function problemBody(problem: ProblemError, instance?: string): ProblemBody {
  const body: ProblemBody = {
    type: `urn:helios:problem:${problem.slug}`,
    title: problem.title,
    status: problem.status,
  };
  if (instance !== undefined) body.instance = instance;
  if (problem.detail !== undefined) body.detail = problem.detail;
  if (problem.errors !== undefined) body.errors = problem.errors;
  return body;
}
