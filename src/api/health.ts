import { performance } from 'node:perf_hooks';
import type { FastifyInstance } from 'fastify';
import { toError, withTimeout } from '../errors.js';

/** A named check of one server this node depends on; resolves when the server answered. */
export type Probe = () => Promise<void> | void;

/** A dependency as readiness sees it. */
export interface Dependency {
  readonly check: Probe;
  /**
   * True: without it the node can do nothing useful, and `/readyz` answers 503. False: the node
   * still serves (degraded), and `/readyz` answers 200 naming it under `degraded`.
   */
  readonly required: boolean;
}

/** What `/readyz` answers. */
export interface Readiness {
  /** `ready`: every dependency answered; `degraded`: only optional ones failed; `unavailable`: a required one failed. */
  readonly status: 'ready' | 'degraded' | 'unavailable';
  /** Every dependency that did not answer, required or not. */
  readonly failing: string[];
  /** The failing dependencies the node can do without for now. */
  readonly degraded: string[];
  readonly checks: Record<string, { ok: boolean; required: boolean; error?: string }>;
}

/** A /readyz answer is reused this long: at most one round trip per server per second. */
export const READINESS_CACHE_MS = 1000;

/**
 * `/healthz`: the process is up. `/readyz`: each dependency answered a real request within 2 s.
 * It answers 503 only when a *required* dependency failed, and names every failing one either way
 * (by error class: no connection strings). A bare {@link Probe} counts as required.
 *
 * Why only PostgreSQL is required on a node (see README, Operations): it is the source of truth,
 * and no role can work without it. With Kafka away, workers still execute through the polling
 * fallback and the API does not use Kafka; with etcd away, the API and workers go on and only
 * leadership waits. Failing readiness for those would make a Kubernetes Service drop every API
 * node at once during a Kafka or etcd outage, which helps nobody; the body still says what is
 * missing, for dashboards and alerts.
 *
 * `/readyz` is open to anyone who reaches the port, so its probes are shared: requests within
 * READINESS_CACHE_MS of a probe round (or during one) get that round's answer instead of starting
 * their own.
 */
export function registerHealthRoutes(app: FastifyInstance, probes: Record<string, Probe | Dependency>): void {
  const dependencies = Object.entries(probes).map(([name, probe]) => {
    const dependency: Dependency = typeof probe === 'function' ? { check: probe, required: true } : probe;
    return [name, dependency] as const;
  });
  app.get('/healthz', async () => ({ status: 'ok' }));
  let cached: { startedAt: number; answer: Promise<Readiness> } | undefined;
  app.get('/readyz', async (_request, reply): Promise<Readiness> => {
    const now = performance.now();
    if (!cached || now - cached.startedAt >= READINESS_CACHE_MS) {
      cached = { startedAt: now, answer: probeAll(dependencies) };
    }
    const readiness = await cached.answer;
    reply.code(readiness.status === 'unavailable' ? 503 : 200);
    return readiness;
  });
}

/** One round of every probe, each bounded by 2 s. */
async function probeAll(dependencies: readonly (readonly [string, Dependency])[]): Promise<Readiness> {
  const results = await Promise.all(
    dependencies.map(async ([name, { check, required }]) => {
      try {
        await withTimeout(Promise.resolve().then(check), 2000, name);
        return [name, { ok: true, required }] as const;
      } catch (err) {
        return [name, { ok: false, required, error: toError(err).name }] as const;
      }
    }),
  );
  const failing = results.filter(([, r]) => !r.ok);
  const unavailable = failing.some(([, r]) => r.required);
  return {
    status: unavailable ? 'unavailable' : failing.length > 0 ? 'degraded' : 'ready',
    failing: failing.map(([name]) => name),
    degraded: failing.filter(([, r]) => !r.required).map(([name]) => name),
    checks: Object.fromEntries(results),
  };
}
