import type { FastifyError, FastifyInstance } from 'fastify';
import { badRequest, toProblem, type ProblemError } from './problems.js';
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
  const route = app.findRoute({ method: method as 'GET', url: path });
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
