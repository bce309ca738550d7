import rateLimit from '@fastify/rate-limit';
import type { FastifyInstance, FastifyRequest } from 'fastify';
import type { TokenVerifier } from './auth.js';
import { ProblemError } from './problems.js';

/**
 * Limits /api/v1 requests per caller: a valid token is one caller wherever it comes from; a
 * request without one (or with an unknown one) counts against its client address, so guessing
 * tokens does not buy a fresh budget. Counters are in this node's memory (fixed windows): the
 * bound is per node, which is what protects each node and the database behind it. Call it
 * before the scope's token check is added: hooks run in the order they were added.
 */
export async function registerRateLimit(
  scope: FastifyInstance,
  verifier: TokenVerifier,
  limit: { readonly max: number; readonly windowMs: number },
): Promise<void> {
  await scope.register(rateLimit, {
    // Not per route (route hooks run after the scope's token check, so a flood of bad tokens
    // would never be counted): one scope hook, added below before the token check.
    global: false,
    max: limit.max,
    timeWindow: limit.windowMs,
    // Every caller seen in one window is a counter; bound them so a spray of addresses cannot
    // grow memory without limit (the least recently seen are forgotten first).
    cache: 10_000,
    keyGenerator: (request: FastifyRequest) => verifier.callerKey(request) ?? `address:${request.ip}`,
    errorResponseBuilder: (_request, context) =>
      new ProblemError(
        429,
        'rate-limited',
        'Too many requests',
        `at most ${context.max} requests per ${context.after} per token; retry after the Retry-After seconds`,
      ),
  });
  scope.addHook('onRequest', scope.rateLimit());
}
