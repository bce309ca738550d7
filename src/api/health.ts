import { performance } from 'node:perf_hooks';
import type { FastifyInstance } from 'fastify';
import { toError, withTimeout } from '../errors.js';

/** A named check of one server this node depends on; resolves when the server answered. */
export type Probe = () => Promise<void>;

/** A /readyz answer is reused this long: at most one round trip per server per second. */
export const READINESS_CACHE_MS = 1000;

/**
 * `/healthz`: the process is up. `/readyz`: every server answered a real request within 2 s;
 * 503 names the servers that did not (without leaking connection strings). `/readyz` is open to
 * anyone who reaches the port, so its probes are shared: requests within READINESS_CACHE_MS of a
 * probe round (or during one) get that round's answer instead of starting their own.
 */
export function registerHealthRoutes(app: FastifyInstance, probes: Record<string, Probe>): void {
  app.get('/healthz', async () => ({ status: 'ok' }));
  let cached: { startedAt: number; answer: ReturnType<typeof probeAll> } | undefined;
  app.get('/readyz', async (_request, reply) => {
    const now = performance.now();
    if (!cached || now - cached.startedAt >= READINESS_CACHE_MS) {
      cached = { startedAt: now, answer: probeAll(probes) };
    }
    const { ready, body } = await cached.answer;
    reply.code(ready ? 200 : 503);
    return body;
  });
}

/** One round of every probe, each bounded by 2 s. */
async function probeAll(probes: Record<string, Probe>) {
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
  const ready = failing.length === 0;
  return { ready, body: { status: ready ? 'ready' : 'unavailable', failing, checks } };
}
