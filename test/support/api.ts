import { Writable } from 'node:stream';
import type { FastifyInstance } from 'fastify';
import { Registry } from 'prom-client';
import type { ApiRole } from '../../src/config/index.js';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { buildApiServer } from '../../src/api/server.js';
import { registerApi } from '../../src/api/v1.js';
import { clusterView } from '../../src/coordination/cluster-view.js';
import { createLogger } from '../../src/observability/logger.js';
import { compileTargetPolicy, type TargetPolicy } from '../../src/security/target-policy.js';
import { sensitiveHeaderSet } from '../../src/security/sensitive-headers.js';
import { createTestDatabase, type TestDatabase } from './database.js';
import { serverEnv, uniqueId } from './env.js';

/** An in-process API server on a real PostgreSQL database and real etcd, listening on loopback. */
export interface TestApi {
  readonly url: string;
  readonly app: FastifyInstance;
  readonly db: TestDatabase;
  readonly etcd: ReturnType<typeof createEtcdClient>;
  readonly etcdPrefix: string;
  readonly runsTopic: string;
  /** Every log line the server wrote (JSON text), for secrecy checks. */
  readonly logs: string[];
  /** fetch() against the server; JSON bodies are encoded, a token becomes a bearer header. */
  call(
    method: string,
    path: string,
    options?: { body?: unknown; raw?: string; token?: string; headers?: Record<string, string> },
  ): Promise<{ status: number; headers: Headers; body: unknown; text: string }>;
  close(): Promise<void>;
}

export const ADMIN = 'admin-token-0123456789abcdef';
export const VIEWER = 'viewer-token-0123456789abcdef';

export async function startTestApi(
  options: {
    tokens?: Map<string, ApiRole>;
    targetPolicy?: TargetPolicy;
    sensitiveHeaders?: string[];
    bodyLimit?: number;
    metricsPublic?: boolean;
    rateLimit?: { max: number; windowMs: number };
    db?: TestDatabase;
    /** Default: the real etcd of `.helios/env`. */
    etcdEndpoints?: string[];
  } = {},
): Promise<TestApi> {
  const db = options.db ?? (await createTestDatabase());
  const etcd = createEtcdClient(options.etcdEndpoints ?? serverEnv().etcdEndpoints.split(','));
  const etcdPrefix = `/helios-test/${uniqueId()}`;
  const runsTopic = `helios.test.${uniqueId()}`;
  const logs: string[] = [];
  const destination = new Writable({
    write(chunk: Buffer, _encoding, done) {
      logs.push(...chunk.toString('utf8').split('\n').filter(Boolean));
      done();
    },
  });
  const logger = createLogger({ level: 'trace', nodeId: 'api-test', destination });
  const app = await buildApiServer({
    logger,
    probes: {},
    metrics: new Registry(),
    bodyLimit: options.bodyLimit,
    register: (server) =>
      registerApi(server, {
        pool: db.pool,
        cluster: clusterView(etcd, etcdPrefix),
        runsTopic,
        tokens: options.tokens ?? new Map(),
        targetPolicy: options.targetPolicy ?? compileTargetPolicy(),
        sensitiveHeaders: sensitiveHeaderSet(options.sensitiveHeaders),
        metricsPublic: options.metricsPublic,
        rateLimit: options.rateLimit,
        logger,
      }),
  });
  await app.listen({ host: '127.0.0.1', port: 0 });
  const address = app.server.address();
  const url = `http://127.0.0.1:${typeof address === 'object' && address ? address.port : 0}`;
  return {
    url,
    app,
    db,
    etcd,
    etcdPrefix,
    runsTopic,
    logs,
    async call(method, path, callOptions = {}) {
      // As the CLI does: an open API takes bodiless writes only with this header.
      const headers: Record<string, string> = { 'x-helios-client': 'test', ...callOptions.headers };
      if (callOptions.token) headers.authorization = `Bearer ${callOptions.token}`;
      let body: string | undefined = callOptions.raw;
      if (callOptions.body !== undefined) body = JSON.stringify(callOptions.body);
      if (body !== undefined) headers['content-type'] ??= 'application/json';
      const response = await fetch(`${url}${path}`, { method, headers, body });
      const text = await response.text();
      let parsed: unknown = text;
      try {
        parsed = text ? JSON.parse(text) : null;
      } catch {
        // not JSON: keep the text
      }
      return { status: response.status, headers: response.headers, body: parsed, text };
    },
    async close() {
      await app.close();
      await etcd
        .delete()
        .prefix(etcdPrefix)
        .catch(() => undefined);
      etcd.close();
      if (!options.db) await db.drop();
    },
  };
}

/** A valid job body; `overrides` replace top-level fields. */
export function jobBody(name: string, overrides: Record<string, unknown> = {}): Record<string, unknown> {
  return {
    name,
    schedule: '*/5 * * * *',
    target: { url: 'http://127.0.0.1:9/hook', method: 'POST', body: { hello: 'world' } },
    ...overrides,
  };
}
