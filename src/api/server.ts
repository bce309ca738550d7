import Fastify, { LogController, type FastifyBaseLogger, type FastifyInstance } from 'fastify';
import { ConfigError, type ApiConfig } from '../config/index.js';
import { toError } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { Registry } from 'prom-client';
import { registerHealthRoutes, type Dependency, type Probe } from './health.js';
import {
  answerNodeRefusals,
  clientErrorHandler,
  MAX_PARAM_LENGTH,
  routerProblem,
} from './framework-errors.js';
import { registerJsonParser } from './json-body.js';
import { badRequest, notFound, sendProblem } from './problems.js';

export interface ApiServerOptions {
  readonly logger: Logger;
  /** Readiness checks by dependency name (see registerHealthRoutes); a bare Probe is required. */
  readonly probes: Record<string, Probe | Dependency>;
  readonly metrics: Registry;
  /** Extra route registrations (the v1 API), applied before listening. */
  readonly register?: (app: FastifyInstance) => Promise<void> | void;
  /** Largest accepted request body in bytes; default 256 KiB. */
  readonly bodyLimit?: number;
}

/** Builds the node's HTTP server: health, readiness, metrics, and whatever `register` adds. */
export async function buildApiServer(options: ApiServerOptions): Promise<FastifyInstance> {
  const logger = options.logger.child({ part: 'api' });
  const app: FastifyInstance = Fastify({
    loggerInstance: logger as FastifyBaseLogger,
    bodyLimit: options.bodyLimit ?? 256 * 1024,
    // Per-request logs would double the log volume at thousands of API calls per second.
    logController: new LogController({ disableRequestLogging: true }),
    forceCloseConnections: true,
    routerOptions: { maxParamLength: MAX_PARAM_LENGTH },
    // The router's own errors (a path that is not valid percent-encoding, an over-long parameter)
    // come before any hook or error handler: without this they were Fastify's plain JSON.
    frameworkErrors: (error, request, reply) => {
      sendProblem(reply, request, routerProblem(app, error, request), logger);
    },
    // Requests Node's HTTP parser refuses (a bad Content-Length, headers too large) never reach
    // Fastify's routing at all.
    clientErrorHandler: clientErrorHandler(logger),
    // Node answers an HTTP/1.1 request without Host with an empty 400 of its own; the hook below
    // refuses it as a problem.
    http: { requireHostHeader: false },
  });
  answerNodeRefusals(app.server);
  registerJsonParser(app);
  // RFC 9112 §3.2: an HTTP/1.1 request carries Host, once (the open API's checks read it; Node
  // keeps the first of several and drops the rest).
  app.addHook('onRequest', async (request) => {
    const { httpVersionMajor, httpVersionMinor, rawHeaders } = request.raw;
    if (httpVersionMajor === 1 && httpVersionMinor === 1 && request.headers.host === undefined) {
      throw badRequest([{ field: 'headers.host', message: 'is required in HTTP/1.1' }]);
    }
    // rawHeaders alternates names and values.
    const hosts = rawHeaders.filter((text, i) => i % 2 === 0 && text.toLowerCase() === 'host').length;
    if (hosts > 1) throw badRequest([{ field: 'headers.host', message: 'is given more than once' }]);
  });
  // Every error outside /api/v1 is a problem too (the v1 scope sets its own, behind its token check).
  app.setErrorHandler((error, request, reply) => sendProblem(reply, request, error, logger));
  app.setNotFoundHandler((request, reply) =>
    sendProblem(reply, request, notFound(`route ${request.method} ${request.url.split('?')[0]}`), logger),
  );
  registerHealthRoutes(app, options.probes);
  app.get('/metrics', async (_request, reply) => {
    reply.type(options.metrics.contentType);
    return options.metrics.metrics();
  });
  await options.register?.(app);
  return app;
}

/** What a failed bind's system error says about the configured address, by its code. */
const BIND_ERRORS: Record<string, { variable: string; message: (api: BindAddress) => string }> = {
  ENOTFOUND: { variable: 'HELIOS_HTTP_HOST', message: ({ host }) => `"${host}" does not resolve` },
  EAI_AGAIN: { variable: 'HELIOS_HTTP_HOST', message: ({ host }) => `"${host}" does not resolve (yet)` },
  EAI_FAIL: { variable: 'HELIOS_HTTP_HOST', message: ({ host }) => `"${host}" does not resolve` },
  EADDRNOTAVAIL: {
    variable: 'HELIOS_HTTP_HOST',
    message: ({ host }) => `"${host}" is not an address of this host`,
  },
  EADDRINUSE: {
    variable: 'HELIOS_HTTP_PORT',
    message: ({ host, port }) => `port ${port} is already in use on ${host}`,
  },
  EACCES: {
    variable: 'HELIOS_HTTP_PORT',
    message: ({ host, port }) =>
      `binding port ${port} on ${host} is not permitted (below 1024 needs privileges)`,
  },
};

type BindAddress = Pick<ApiConfig, 'host' | 'port'>;

/**
 * Binds `app` to HELIOS_HTTP_HOST:HELIOS_HTTP_PORT. A bind that fails for the address itself (a
 * name that does not resolve, a port in use) is the operator's to fix: a ConfigError naming the
 * variable, which `helios node` prints as one line, with the system error as its cause.
 */
export async function listenOn(app: Pick<FastifyInstance, 'listen'>, address: BindAddress): Promise<void> {
  try {
    await app.listen({ host: address.host, port: address.port });
  } catch (err) {
    const error = toError(err);
    const code = (error as NodeJS.ErrnoException).code ?? '';
    const known = BIND_ERRORS[code];
    if (!known) throw error;
    throw new ConfigError(known.variable, `${known.message(address)} (${code})`, { cause: error });
  }
}
