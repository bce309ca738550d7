import type { FastifyInstance } from 'fastify';
import { toError, withTimeout } from '../errors.js';

/** A named check of one server this node depends on; resolves when the server answered. */
export type Probe = () => Promise<void>;

/**
 * `/healthz`: the process is up. `/readyz`: every server answered a real request within 2 s;
 * 503 names the servers that did not (without leaking connection strings).
 */
export function registerHealthRoutes(app: FastifyInstance, probes: Record<string, Probe>): void {
  app.get('/healthz', async () => ({ status: 'ok' }));
  app.get('/readyz', async (_request, reply) => {
    const results = await Promise.all(
      Object.entries(probes).map(async ([name, probe]) => {
        try {
          await withTimeout(probe(), 2000, name);
          return [name, { ok: true }] as const;
        } catch (err) {
          return [name, { ok: false, error: toError(err).name }] as const;
        }
      }),
    );
    const checks = Object.fromEntries(results);
    const failing = results.filter(([, r]) => !r.ok).map(([name]) => name);
    reply.code(failing.length === 0 ? 200 : 503);
    return { status: failing.length === 0 ? 'ready' : 'unavailable', failing, checks };
  });
}
