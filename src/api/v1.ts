import type { TypeBoxTypeProvider } from '@fastify/type-provider-typebox';
import type { FastifyInstance } from 'fastify';
import type { ApiRole } from '../config/index.js';
import { TokenVerifier } from './auth.js';
import { viewerView } from './views.js';
import type { Api, ApiOptions } from './context.js';
import { registerOpenApi } from './openapi.js';
import { checkOpenModeRequest } from './open-mode.js';
import { checkTargetName } from './target-name.js';
import { registerRateLimit } from './rate-limit.js';
import { notFound, sendProblem } from './problems.js';
import { validatorCompiler } from './validation.js';
import { clusterRoutes } from './routes/cluster.js';
import { deadLetterRoutes } from './routes/dead-letters.js';
import { jobActionRoutes } from './routes/job-actions.js';
import { jobRoutes } from './routes/jobs.js';
import { runRoutes } from './routes/runs.js';

/**
 * Adds the operator API to a node's server (pass it as buildApiServer's `register`):
 * `/api/v1/*` behind bearer tokens, `/openapi.json` and `/docs`, and the token check on
 * `/metrics` unless `metricsPublic`. `/healthz` and `/readyz` stay open.
 */
export async function registerApi(app: FastifyInstance, options: ApiOptions): Promise<void> {
  const verifier = new TokenVerifier(options.tokens);
  const logger = options.logger.child({ part: 'api' });
  if (verifier.open) {
    // Root-level, so /metrics, /docs and /openapi.json are covered too; /healthz and /readyz stay
    // open to any Host (a prober may use a name) and change nothing.
    app.addHook('onRequest', async (request, reply) => {
      const path = request.url.split('?')[0];
      if (path === '/healthz' || path === '/readyz') return;
      try {
        checkOpenModeRequest(request);
      } catch (err) {
        return sendProblem(reply, request, err, logger);
      }
    });
  }
  if (!options.metricsPublic) {
    // Root-level hook: it also applies to /metrics, which buildApiServer declared earlier.
    app.addHook('onRequest', async (request, reply) => {
      if (request.routeOptions.url !== '/metrics') return;
      try {
        verifier.authorize(request, 'viewer');
      } catch (err) {
        return sendProblem(reply, request, err, logger);
      }
    });
  }
  if (options.routes === false) return;
  await registerOpenApi(app);
  await app.register(
    async (scope) => {
      if (options.rateLimit) await registerRateLimit(scope, verifier, options.rateLimit);
      const v1: Api = scope.withTypeProvider<TypeBoxTypeProvider>();
      v1.setValidatorCompiler(validatorCompiler);
      // JSON only: anything else is a 415, not a string that fails validation.
      v1.removeContentTypeParser(['text/plain']);
      v1.setErrorHandler((error, request, reply) => sendProblem(reply, request, error, logger));
      // Before the not-found handler, so unknown paths need a token too.
      const roles = new WeakMap<object, ApiRole>();
      v1.addHook('onRequest', async (request) => {
        roles.set(request, verifier.authorize(request));
      });
      // Excerpts and URL query strings are admin-only: one place masks them in every response.
      v1.addHook('preSerialization', async (request, reply, payload) =>
        roles.get(request) === 'viewer' && reply.statusCode < 300 ? viewerView(payload) : payload,
      );
      // A name in target.url is resolved at save time too (the worker checks again when it connects).
      v1.addHook('preHandler', async (request) => checkTargetName(request, options.targetPolicy));
      v1.setNotFoundHandler((request, reply) =>
        sendProblem(reply, request, notFound(`route ${request.method} ${request.url.split('?')[0]}`), logger),
      );
      jobRoutes(v1, options);
      jobActionRoutes(v1, options);
      runRoutes(v1, options);
      deadLetterRoutes(v1, options);
      clusterRoutes(v1, options);
    },
    { prefix: '/api/v1' },
  );
}
