import { Type, type Static, type TLiteral, type TUnion } from 'typebox';
import { CONCURRENCY_POLICIES, MISFIRE_POLICIES, RUN_STATES } from '../model.js';
import { CLUSTER_COUNT_CAP } from '../observability/cluster-signals.js';

// Request and response schemas of /api/v1. They validate requests (src/api/validation.ts),
// serialise responses, and are the OpenAPI document. Objects never accept unknown properties.

/** One literal schema per value, as a tuple (TypeBox 1.x infers a union's type from a tuple). */
type Literals<T extends readonly string[]> = { -readonly [K in keyof T]: TLiteral<T[K]> };

function oneOf<const T extends readonly string[]>(values: T, description?: string) {
  return Type.Union(
    values.map((v) => Type.Literal(v)),
    { description },
  ) as unknown as TUnion<Literals<T>>;
}

const closed = { additionalProperties: false } as const;
const Nullable = <T extends Parameters<typeof Type.Union>[0][number]>(schema: T) =>
  Type.Union([schema, Type.Null()]);
const DateTime = Type.String({ format: 'date-time' });
const Uuid = Type.String({ format: 'uuid' });

export const NAME_PATTERN = '^[a-z0-9][a-z0-9._-]{0,127}$';
export const HEADER_NAME_PATTERN = "^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$";
export const METHODS = ['GET', 'HEAD', 'POST', 'PUT', 'PATCH', 'DELETE', 'OPTIONS'] as const;

/** What a job gets for each field the request leaves out. */
export const JOB_DEFAULTS = Object.freeze({
  timezone: 'UTC',
  method: 'GET',
  methodWithBody: 'POST',
  timeoutMs: 30_000,
  retry: Object.freeze({ maxAttempts: 3, backoffMs: 1000, backoffMultiplier: 2 }),
  concurrency: 'allow',
  misfire: 'fire-once',
  maxCatchUp: 100,
  enabled: true,
} as const);

const Method = oneOf(METHODS, 'HTTP method; default POST with a body, else GET');
const Concurrency = oneOf(CONCURRENCY_POLICIES, 'while a run is active; default allow');
const Misfire = oneOf(MISFIRE_POLICIES, 'missed occurrences; default fire-once');
const RunState = oneOf(RUN_STATES);

const Headers = Type.Record(
  Type.String({ pattern: HEADER_NAME_PATTERN }),
  Type.String({ maxLength: 8192, pattern: '^[^\\r\\n\\u0000]*$' }),
  { ...closed, maxProperties: 64, description: 'sensitive header values are returned as "***"' },
);

const TargetInput = Type.Object(
  {
    url: Type.String({ minLength: 1, maxLength: 2048, description: 'http or https URL' }),
    method: Type.Optional(Method),
    headers: Type.Optional(Headers),
    body: Type.Optional(
      Type.Unknown({
        description:
          'any JSON value, sent JSON-encoded (content-type application/json unless set); at most 64 KiB, nesting depth 32',
      }),
    ),
  },
  closed,
);

const RetryInput = Type.Object(
  {
    maxAttempts: Type.Integer({ minimum: 1, maximum: 100 }),
    backoffMs: Type.Integer({ minimum: 0, maximum: 86_400_000 }),
    backoffMultiplier: Type.Optional(
      Type.Number({
        minimum: 1,
        maximum: 10,
        description: 'default 2; stored as a real, so at most about 7 significant digits (more is a 400)',
      }),
    ),
  },
  closed,
);

const jobInputFields = {
  name: Type.String({ pattern: NAME_PATTERN, maxLength: 128 }),
  schedule: Type.String({ minLength: 1, maxLength: 256, description: 'cron, 5 fields or 6 with seconds' }),
  timezone: Type.Optional(
    Type.String({ minLength: 1, maxLength: 64, description: 'IANA zone; default UTC' }),
  ),
  target: TargetInput,
  timeoutMs: Type.Optional(Type.Integer({ minimum: 100, maximum: 3_600_000, description: 'default 30000' })),
  retry: Type.Optional(RetryInput),
  concurrency: Type.Optional(Concurrency),
  misfire: Type.Optional(Misfire),
  maxCatchUp: Type.Optional(Type.Integer({ minimum: 1, maximum: 10_000, description: 'default 100' })),
  enabled: Type.Optional(Type.Boolean({ description: 'default true' })),
};

export const JobInput = Type.Object(jobInputFields, { ...closed, title: 'JobInput' });
export type JobInput = Static<typeof JobInput>;

/** PATCH: any subset of the job's fields; each given field replaces the stored one whole. */
export const JobPatch = Type.Partial(Type.Object(jobInputFields, closed), { ...closed, title: 'JobPatch' });
export type JobPatch = Static<typeof JobPatch>;

const Target = Type.Object(
  {
    url: Type.String(),
    method: Method,
    headers: Type.Record(Type.String(), Type.String()),
    body: Type.Optional(Type.Unknown()),
  },
  closed,
);
const Retry = Type.Object(
  { maxAttempts: Type.Integer(), backoffMs: Type.Integer(), backoffMultiplier: Type.Number() },
  closed,
);

export const Job = Type.Object(
  {
    id: Uuid,
    name: Type.String(),
    schedule: Type.String(),
    timezone: Type.String(),
    target: Target,
    timeoutMs: Type.Integer(),
    retry: Retry,
    concurrency: Concurrency,
    misfire: Misfire,
    maxCatchUp: Type.Integer(),
    enabled: Type.Boolean(),
    nextRunAt: Nullable(DateTime),
    scheduleError: Nullable(
      Type.String({
        description:
          'Why the scheduler stopped planning this job (its schedule could not be evaluated); an edit of the schedule or a resume clears it',
      }),
    ),
    createdAt: DateTime,
    updatedAt: DateTime,
  },
  { ...closed, title: 'Job' },
);
export type Job = Static<typeof Job>;

const runFields = {
  id: Uuid,
  jobId: Uuid,
  scheduledFor: DateTime,
  trigger: oneOf(['schedule', 'manual']),
  state: RunState,
  attempt: Type.Integer({ description: 'latest attempt claimed; 0 = never started' }),
  maxAttempts: Type.Integer(),
  notBefore: DateTime,
  claimedBy: Nullable(Type.String()),
  reason: Nullable(Type.String()),
  lastStatus: Nullable(Type.Integer()),
  lastError: Nullable(Type.String()),
  createdAt: DateTime,
  startedAt: Nullable(DateTime),
  finishedAt: Nullable(DateTime),
};
export const Run = Type.Object(runFields, { ...closed, title: 'Run' });
export type Run = Static<typeof Run>;

const Attempt = Type.Object(
  {
    attempt: Type.Integer(),
    nodeId: Type.String(),
    startedAt: DateTime,
    finishedAt: Nullable(DateTime),
    outcome: Nullable(Type.String()),
    statusCode: Nullable(Type.Integer()),
    durationMs: Nullable(Type.Integer()),
    error: Nullable(Type.String()),
    responseExcerpt: Nullable(Type.String()),
  },
  closed,
);

export const RunDetail = Type.Object(
  {
    ...runFields,
    target: Target,
    timeoutMs: Type.Integer(),
    claimExpiresAt: Nullable(DateTime),
    attempts: Type.Array(Attempt),
  },
  { ...closed, title: 'RunDetail' },
);
export type RunDetail = Static<typeof RunDetail>;

export const DeadLetter = Type.Object(
  {
    id: Uuid,
    runId: Uuid,
    jobId: Uuid,
    jobName: Type.String(),
    attempt: Type.Integer(),
    error: Nullable(Type.String()),
    statusCode: Nullable(Type.Integer()),
    createdAt: DateTime,
    replayedAt: Nullable(DateTime),
    replayCount: Type.Integer(),
  },
  { ...closed, title: 'DeadLetter' },
);
export type DeadLetter = Static<typeof DeadLetter>;

const CAPPED_COUNT = `at most ${CLUSTER_COUNT_CAP}: counting stops there, so a huge backlog costs no more to read`;

export const Cluster = Type.Object(
  {
    leader: Nullable(
      Type.Object({ nodeId: Type.String(), fencingToken: Type.Integer(), since: Type.String() }, closed),
    ),
    nodes: Type.Array(
      Type.Object(
        {
          id: Type.String(),
          host: Type.String(),
          pid: Type.Integer(),
          apiUrl: Nullable(Type.String()),
          roles: Type.Array(Type.String()),
          lastSeen: Type.String(),
        },
        closed,
      ),
    ),
    outbox: Type.Object(
      {
        pending: Type.Integer({ description: CAPPED_COUNT }),
        oldestDueAgeSeconds: Type.Number({
          description: 'how long the oldest due, unpublished row has waited; 0 when none is due',
        }),
      },
      closed,
    ),
    runs: Type.Object(
      {
        queued: Type.Integer({ description: CAPPED_COUNT }),
        overdue: Type.Integer({
          description: `queued runs due longer ago than the misfire threshold (HELIOS_MISFIRE_THRESHOLD_MS), but those in waitingForbid; ${CAPPED_COUNT}`,
        }),
        waitingForbid: Type.Integer({
          description: `queued retries and replays of forbid jobs, due, waiting for the job's running run to end (helios_runs_waiting_forbid); ${CAPPED_COUNT}`,
        }),
        running: Type.Integer({ description: CAPPED_COUNT }),
      },
      closed,
    ),
    deadLetters: Type.Object(
      { open: Type.Integer({ description: `dead letters not replayed; ${CAPPED_COUNT}` }) },
      closed,
    ),
  },
  { ...closed, title: 'Cluster' },
);
export type Cluster = Static<typeof Cluster>;

export const RunCreated = Type.Object({ runId: Uuid }, { ...closed, title: 'RunCreated' });

export const Problem = Type.Object(
  {
    type: Type.String(),
    title: Type.String(),
    status: Type.Integer(),
    detail: Type.Optional(Type.String()),
    instance: Type.Optional(Type.String()),
    errors: Type.Optional(Type.Array(Type.Object({ field: Type.String(), message: Type.String() }, closed))),
  },
  { ...closed, title: 'Problem', description: 'RFC 9457 problem details' },
);

/** `{ items, nextCursor }`: nextCursor is null on the last page. */
export const Page = <T extends Parameters<typeof Type.Array>[0]>(item: T) =>
  Type.Object({ items: Type.Array(item), nextCursor: Nullable(Type.String()) }, closed);

export const PageQuery = Type.Object(
  {
    limit: Type.Optional(Type.Integer({ minimum: 1, maximum: 500, description: 'default 50' })),
    cursor: Type.Optional(Type.String({ maxLength: 512, description: 'nextCursor of the previous page' })),
  },
  closed,
);
export type PageQuery = Static<typeof PageQuery>;

export const RunsQuery = Type.Object({ ...PageQuery.properties, state: Type.Optional(RunState) }, closed);
export type RunsQuery = Static<typeof RunsQuery>;

/** Longest `{id}` a route takes (a job's id or name, a run's or dead letter's id); the router's bound too. */
export const MAX_ID_LENGTH = 200;
export const IdParams = Type.Object({ id: Type.String({ maxLength: MAX_ID_LENGTH }) }, closed);
export type IdParams = Static<typeof IdParams>;
