import type { Database } from '../store/db.js';
import type { TypeBoxTypeProvider } from '@fastify/type-provider-typebox';
import type {
  FastifyBaseLogger,
  FastifyInstance,
  RawReplyDefaultExpression,
  RawRequestDefaultExpression,
  RawServerDefault,
} from 'fastify';
import type { ClusterView } from '../coordination/cluster-view.js';
import type { ApiRole } from '../config/index.js';
import type { Logger } from '../observability/logger.js';
import type { TargetPolicy } from '../security/target-policy.js';
import type { CommandOptions } from '../jobs/commands.js';
import { Problem } from './schemas.js';

/** What the v1 API needs from the node; every field comes from HeliosConfig or a started part. */
export interface ApiOptions {
  readonly pool: Database;
  /** Leader and registered nodes, for GET /cluster (coordination/cluster-view.ts). */
  readonly cluster: ClusterView;
  /** Topic of run messages written to the outbox by manual triggers and replays. */
  readonly runsTopic: string;
  /** Token → role; empty means the API is open (the node then binds loopback only). */
  readonly tokens: ReadonlyMap<string, ApiRole>;
  readonly targetPolicy: TargetPolicy;
  /** Lower-case header names whose values are shown as `***`. */
  readonly sensitiveHeaders: ReadonlySet<string>;
  /** HELIOS_MISFIRE_THRESHOLD_MS: job commands judge due occurrences as the dispatcher does; default 5000. */
  readonly misfireThresholdMs?: number;
  /**
   * Per-token (per client address without a valid token) limit on /api/v1 requests: at most
   * `max` per `windowMs`, then 429 with Retry-After. Default none (the node passes its config's).
   */
  readonly rateLimit?: { readonly max: number; readonly windowMs: number };
  /** Serve /metrics without a token even when tokens are configured; default false. */
  readonly metricsPublic?: boolean;
  /** Serve /api/v1, /openapi.json and /docs; false keeps only the /metrics token check. Default true. */
  readonly routes?: boolean;
  readonly logger: Logger;
}

/** The Fastify instance routes are declared on: TypeBox schemas type the handlers. */
export type Api = FastifyInstance<
  RawServerDefault,
  RawRequestDefaultExpression,
  RawReplyDefaultExpression,
  FastifyBaseLogger,
  TypeBoxTypeProvider
>;

const PROBLEM_RESPONSE = {
  description: 'RFC 9457 problem details naming the failing fields',
  content: { 'application/problem+json': { schema: Problem } },
};

/** Response schemas of the problem statuses a route can answer with (application/problem+json). */
export function problems(...statuses: number[]): Record<number, typeof PROBLEM_RESPONSE> {
  return Object.fromEntries(statuses.map((status) => [status, PROBLEM_RESPONSE]));
}

/** Statuses every /api/v1 route can answer with (auth, rate limit, server failure, database outage). */
export const COMMON_PROBLEMS = [401, 403, 429, 500, 503] as const;

/** What the job commands need, from the API's options (one place for the defaults). */
export function commandOptions(options: ApiOptions): CommandOptions {
  return {
    runsTopic: options.runsTopic,
    misfireThresholdMs: options.misfireThresholdMs ?? 5000,
    logger: options.logger,
  };
}
