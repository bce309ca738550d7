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
 */
export function registerHealthRoutes(app: FastifyInstance, probes: Record<string, Probe | Dependency>): void {
  const dependencies = Object.entries(probes).map(([name, probe]) => {
    const dependency: Dependency = typeof probe === 'function' ? { check: probe, required: true } : probe;
    return [name, dependency] as const;
  });
  app.get('/healthz', async () => ({ status: 'ok' }));
  app.get('/readyz', async (_request, reply): Promise<Readiness> => {
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
    reply.code(unavailable ? 503 : 200);
    return {
      status: unavailable ? 'unavailable' : failing.length > 0 ? 'degraded' : 'ready',
      failing: failing.map(([name]) => name),
      degraded: failing.filter(([, r]) => !r.required).map(([name]) => name),
      checks: Object.fromEntries(results),
    };
  });
}
