import swagger from '@fastify/swagger';
import swaggerUi from '@fastify/swagger-ui';
import type { FastifyInstance } from 'fastify';

/**
 * The OpenAPI 3.1 document, generated from the routes' schemas, at `GET /openapi.json`, and
 * Swagger UI at `GET /docs` (its assets ship in the package: no CDN, works offline). Both are
 * public: the document describes the API, it holds no data. Register before the routes.
 */
export async function registerOpenApi(app: FastifyInstance): Promise<void> {
  await app.register(swagger, {
    openapi: {
      openapi: '3.1.0',
      info: {
        title: 'Helios API',
        version: '1.0.0',
        description:
          'Distributed cron scheduler. Errors are RFC 9457 application/problem+json bodies naming the failing field.',
      },
      components: { securitySchemes: { bearer: { type: 'http', scheme: 'bearer' } } },
      security: [{ bearer: [] }],
      tags: [
        { name: 'jobs', description: 'cron jobs and their runs' },
        { name: 'runs', description: 'run history' },
        { name: 'dead-letters', description: 'runs that used up their attempts' },
        { name: 'cluster', description: 'leader, nodes, queues' },
      ],
    },
  });
  await app.register(swaggerUi, {
    routePrefix: '/docs',
    staticCSP: true,
    // No call-out to the public validator service: this page must work without internet.
    uiConfig: { validatorUrl: null, deepLinking: true },
  });
  app.get('/openapi.json', { schema: { hide: true } }, async () => app.swagger());
}
