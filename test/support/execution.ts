import { randomUUID } from 'node:crypto';
import { createServer, type IncomingMessage, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import type pg from 'pg';
import type { AttemptReport } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import { withdrawFutureRuns } from '../../src/store/jobs.js';

/** One request the target received. */
export interface TargetRequest {
  readonly method: string;
  readonly path: string;
  readonly runId: string;
  readonly jobId: string;
  readonly idempotencyKey: string;
  readonly attempt: number;
  readonly scheduledFor: string;
  readonly headers: IncomingMessage['headers'];
  readonly body: string;
  /** Arrival (ms since the epoch, sub-ms precision): when the request's headers were parsed. */
  readonly arrivedAt: number;
  /** When the response was sent, or the connection closed without one. */
  endedAt?: number;
  /** True when the client went away before we answered (an aborted call). */
  aborted?: boolean;
  /** The status the target chose to answer with (absent when it hung). */
  status?: number;
}

/** How the target answers one request; `nth` counts requests of the same run id from 1. */
export type Behaviour = (
  request: TargetRequest,
  nth: number,
) => {
  status?: number;
  delayMs?: number;
  /** Never answer (until the client gives up). */
  hang?: boolean;
  /** Answer only once this settles (then after `delayMs`): a call held open until the test lets it end. */
  until?: Promise<unknown>;
  /** Send the status and headers at once (after `delayMs`), the body this much later. */
  bodyAfterMs?: number;
  body?: string;
};

const now = () => performance.timeOrigin + performance.now();

/** A real HTTP server on 127.0.0.1 that records every request (the job target of the tests). */
export class TargetServer {
  readonly requests: TargetRequest[] = [];
  private readonly server: Server;
  private readonly perRun = new Map<string, number>();

  constructor(private behaviour: Behaviour = () => ({ status: 200 })) {
    this.server = createServer((req, res) => {
      const arrivedAt = now();
      const chunks: Buffer[] = [];
      req.on('data', (chunk: Buffer) => chunks.push(chunk));
      req.on('end', () => {
        const header = (name: string) => String(req.headers[name] ?? '');
        const record: TargetRequest = {
          method: req.method ?? '',
          path: req.url ?? '',
          runId: header('x-helios-run-id'),
          jobId: header('x-helios-job-id'),
          idempotencyKey: header('idempotency-key'),
          attempt: Number(header('x-helios-attempt')),
          scheduledFor: header('x-helios-scheduled-for'),
          headers: req.headers,
          body: Buffer.concat(chunks).toString('utf8'),
          arrivedAt,
        };
        this.requests.push(record);
        const nth = (this.perRun.get(record.runId) ?? 0) + 1;
        this.perRun.set(record.runId, nth);
        const answer = this.behaviour(record, nth);
        if (!answer.hang) record.status = answer.status ?? 200;
        res.on('close', () => {
          record.endedAt ??= now();
          if (!res.writableFinished) record.aborted = true;
        });
        if (answer.hang) return;
        const respond = () => {
          if (res.destroyed) return;
          res.writeHead(answer.status ?? 200, { 'content-type': 'text/plain' });
          if (answer.bodyAfterMs === undefined) return res.end(answer.body ?? 'ok');
          res.flushHeaders();
          const timer = setTimeout(() => res.end(answer.body ?? 'ok'), answer.bodyAfterMs);
          res.on('close', () => clearTimeout(timer));
        };
        const answerNow = () => {
          if (answer.delayMs) setTimeout(respond, answer.delayMs);
          else respond();
        };
        if (answer.until) void answer.until.then(answerNow, answerNow);
        else answerNow();
      });
    });
  }

  setBehaviour(behaviour: Behaviour): void {
    this.behaviour = behaviour;
  }

  /** Listens on `host` (loopback by default; the chaos test's bridge address for its namespaces). */
  async start(host = '127.0.0.1'): Promise<string> {
    await new Promise<void>((resolve) => this.server.listen(0, host, resolve));
    return this.url;
  }

  get url(): string {
    const { address, port } = this.server.address() as AddressInfo;
    return `http://${address}:${port}`;
  }

  /** Requests of one job, in arrival order. */
  forJob(jobId: string): TargetRequest[] {
    return this.requests.filter((r) => r.jobId === jobId);
  }

  /** How many requests each run id received. */
  countsByRun(): Map<string, number> {
    const counts = new Map<string, number>();
    for (const r of this.requests) counts.set(r.runId, (counts.get(r.runId) ?? 0) + 1);
    return counts;
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

/** A job as the tests create it (directly in the table: the REST API is not needed here). */
export interface JobSpec {
  name: string;
  schedule: string;
  target: { url: string; method?: string; headers?: Record<string, string>; body?: unknown };
  nextRunAt: Date;
  timeoutMs?: number;
  maxAttempts?: number;
  backoffMs?: number;
  backoffMultiplier?: number;
  concurrency?: 'allow' | 'forbid' | 'replace';
}

export async function insertJob(db: pg.Pool, spec: JobSpec): Promise<string> {
  const { rows } = await db.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, backoff_ms, backoff_multiplier,
                       concurrency, next_run_at)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING id`,
    [
      spec.name,
      spec.schedule,
      spec.target,
      spec.timeoutMs ?? 5000,
      spec.maxAttempts ?? 3,
      spec.backoffMs ?? 1000,
      spec.backoffMultiplier ?? 2,
      spec.concurrency ?? 'allow',
      spec.nextRunAt,
    ],
  );
  return rows[0]!.id;
}

/**
 * Queued runs of job `jobId` due at each of `dueAt` (SQL timestamp expressions, oldest first),
 * copying the job's target, timeout and concurrency, with three attempts and no back-off, made
 * directly in the table (as occurrences, or as manual runs); their ids in that order.
 */
export async function queuedRuns(
  db: pg.Pool,
  jobId: string,
  dueAt: string[],
  trigger: 'schedule' | 'manual' = 'schedule',
): Promise<string[]> {
  const { rows } = await db.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, trigger, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, concurrency, not_before)
     SELECT j.id, o.t, $2, 'queued', 3, j.target, j.timeout_ms, 0, 2, j.concurrency, o.t
     FROM jobs j, (VALUES ${dueAt.map((at) => `((${at})::timestamptz)`).join(', ')}) o (t)
     WHERE j.id = $1 ORDER BY o.t RETURNING id`,
    [jobId, trigger],
  );
  return rows.map((r) => r.id);
}

/**
 * A job named `name`-<unique> calling a closed port (1 s timeout, 3 attempts, its next run an hour
 * away: no dispatcher makes runs of it here) and its queuedRuns due at `dueAt`.
 */
export async function jobWithQueuedRuns(
  db: pg.Pool,
  spec: { name: string; schedule: string; concurrency: 'allow' | 'forbid' | 'replace'; dueAt: string[] },
): Promise<{ job: string; runs: string[] }> {
  const job = await insertJob(db, {
    name: `${spec.name}-${randomUUID()}`,
    schedule: spec.schedule,
    target: { url: 'http://127.0.0.1:9/' },
    nextRunAt: new Date(Date.now() + 3_600_000),
    timeoutMs: 1000,
    maxAttempts: 3,
    concurrency: spec.concurrency,
  });
  return { job, runs: await queuedRuns(db, job, spec.dueAt) };
}

/**
 * Inserts `count` every-second jobs named `healthy-N` calling `url` (one attempt, 5 s timeout),
 * first due at the next whole second; returns their ids.
 */
export async function insertEverySecondJobs(db: pg.Pool, url: string, count: number): Promise<string[]> {
  const { rows } = await db.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts, next_run_at)
     SELECT 'healthy-' || i, '* * * * * *', jsonb_build_object('url', $1::text), 5000, 1,
            date_trunc('second', now()) + interval '1 second'
     FROM generate_series(1, $2::int) AS i RETURNING id`,
    [url, count],
  );
  return rows.map((r) => r.id);
}

/**
 * Stops jobs as an edit through the API would: disabled, and their runs created ahead of their
 * time (the dispatch lookahead) withdrawn, so nothing of theirs fires afterwards.
 */
export async function stopJobs(db: pg.Pool, jobIds: string[]): Promise<void> {
  await db.query('UPDATE jobs SET enabled = false WHERE id = ANY($1::uuid[])', [jobIds]);
  for (const id of jobIds) await inTransaction(db, (c) => withdrawFutureRuns(c, id));
}

/** A whole second at least `aheadMs` from now by the database clock. */

export async function nextWholeSecond(db: pg.Pool, aheadMs: number): Promise<Date> {
  const { rows } = await db.query<{ at: Date }>(
    `SELECT date_trunc('second', now() + $1 * interval '1 millisecond') + interval '1 second' AS at`,
    [aheadMs],
  );
  return rows[0]!.at;
}

/** A cron expression (6 fields) that fires once a minute, at `at`'s second. */
export function oncePerMinuteAt(at: Date): string {
  return `${at.getUTCSeconds()} * * * * *`;
}

/** Polls `check` until it returns a truthy value; fails with `what` after `timeoutMs`. */
export async function waitFor<T>(
  what: string,
  check: () => Promise<T> | T,
  timeoutMs = 20_000,
  everyMs = 50,
): Promise<NonNullable<T>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value as NonNullable<T>;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(everyMs);
  }
}

/** Runs of a job with their attempts, oldest first. */
export async function runsOf(db: pg.Pool, jobId: string) {
  const { rows } = await db.query<{
    id: string;
    state: string;
    attempt: number;
    reason: string | null;
    scheduledFor: Date;
    lastStatus: number | null;
  }>(
    `SELECT id, state, attempt, reason, scheduled_for AS "scheduledFor", last_status AS "lastStatus"
     FROM runs WHERE job_id = $1 ORDER BY scheduled_for`,
    [jobId],
  );
  return rows;
}

export async function attemptsOf(db: pg.Pool, runId: string) {
  const { rows } = await db.query<{
    attempt: number;
    nodeId: string;
    outcome: string | null;
    statusCode: number | null;
    durationMs: number | null;
    error: string | null;
    responseExcerpt: string | null;
    startedAt: Date;
  }>(
    `SELECT attempt, node_id AS "nodeId", outcome, status_code AS "statusCode", duration_ms AS "durationMs",
            error, response_excerpt AS "responseExcerpt", started_at AS "startedAt"
     FROM run_attempts WHERE run_id = $1 ORDER BY attempt`,
    [runId],
  );
  return rows;
}

/** Percentile (nearest rank) of `values`. */
export function percentile(values: number[], p: number): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))] ?? NaN;
}

/** A call the target answered 500, as a worker reports it; `retryable: false` buries the run at once. */
export function http500Report(retryable = true): AttemptReport {
  return {
    outcome: 'failed',
    statusCode: 500,
    durationMs: 1,
    error: 'HTTP 500',
    responseExcerpt: null,
    retryable,
  };
}

/**
 * Resolves once `count` statements on the pool's database wait for a lock (a row another session
 * holds), only statements whose text contains `fragment` counted when it is given; throws after
 * `timeoutMs` (waitFor's default when absent), looking every `everyMs`.
 */
export async function untilWaitingForLocks(
  pool: Pick<pg.Pool, 'query'>,
  options: { count?: number; fragment?: string; timeoutMs?: number; everyMs?: number } = {},
): Promise<void> {
  const { count = 1, fragment, timeoutMs, everyMs } = options;
  await waitFor(
    `${count} statement(s)${fragment === undefined ? '' : ` with "${fragment}"`} waiting for a lock`,
    async () => {
      const { rows } = await pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND ($1::text IS NULL OR position($1 in query) > 0)`,
        [fragment ?? null],
      );
      return rows[0]!.n >= count;
    },
    timeoutMs,
    everyMs,
  );
}
