import { connect } from 'node:net';
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

/**
 * The jobs table (as a hash of its rows) and the counts of runs and outbox rows: equal before and
 * after a refused request when nothing was half-written.
 */
export async function tableState(api: TestApi): Promise<string> {
  const { rows } = await api.db.pool.query<{ jobs: string; runs: number; outbox: number }>(
    `SELECT (SELECT md5(coalesce(string_agg(j::text, ',' ORDER BY j.id), '')) FROM jobs j) AS jobs,
            (SELECT count(*)::int FROM runs) AS runs, (SELECT count(*)::int FROM outbox) AS outbox`,
  );
  return JSON.stringify(rows[0]);
}

/**
 * Sends `text` as a request's raw bytes to `api` and reads the answer until the server closes (5 s
 * at most); a body that is not JSON is kept as text for assertion messages.
 */
export async function rawRequest(
  api: TestApi,
  text: string,
): Promise<{ status: number; contentType: string; body: unknown }> {
  const socket = connect(Number(new URL(api.url).port), '127.0.0.1');
  socket.on('error', () => undefined); // the server may reset the connection after answering
  // Not end(): a request whose sender has half-closed is dropped before its answer is written.
  socket.write(text);
  const timer = setTimeout(() => socket.destroy(), 5000);
  const chunks: Buffer[] = [];
  try {
    for await (const chunk of socket) chunks.push(chunk as Buffer);
  } finally {
    clearTimeout(timer);
  }
  const [head = '', body = ''] = Buffer.concat(chunks).toString('utf8').split('\r\n\r\n');
  let parsed: unknown = body;
  try {
    parsed = JSON.parse(body);
  } catch {
    // not JSON: kept as text for the assertion message
  }
  return {
    status: Number(/^HTTP\/1\.1 (\d{3})/.exec(head)?.[1]),
    contentType: /^content-type: *(.*)$/im.exec(head)?.[1] ?? '',
    body: parsed,
  };
}
