import type { RunMessage } from '../model.js';
import {
  announceNextAttempts,
  claimOver,
  recordAttemptOutcomes,
  clean,
  type AttemptReport,
  type ExpiryOptions,
} from './attempts.js';
import { withReadTimeout, type Queryable } from './db.js';
import { inLockOrder, nextAttemptMessage, type RequeuedRun } from './runs.js';

/**
 * RELEASE, the attempt's record and the next attempt's announcement (releaseClaim in attempts.ts),
 * for many claims node $2 gives back, in one statement: each run queued again without using up an
 * attempt (max_attempts grows by one), due when it was due or at once. Parallel arrays: $1 = run
 * ids, $3 = attempts, $4 = outcomes, $5 = statuses, $6 = errors, $7 = when each call began,
 * $8 = durations ms, $9 = response excerpts, $11 = expiry bounds (see Release.expiryBound; NULL:
 * none); $10 = the runs topic. The announcements are those the single path writes
 * (announceNextAttempts). Returns the runs whose claim node $2 still held (and, with a bound, whose
 * forgiven expiries were under it), as RequeuedRun.
 */
const RELEASE_MANY = `
  WITH input AS MATERIALIZED (
    -- Node and state ride along as columns of a materialised input, as in SUCCEED (attempts.ts:
    -- one primary-key lookup per run, whatever the statistics say).
    SELECT i.*, $2::text AS node, 'running'::text AS running
    FROM unnest($1::uuid[], $3::int[], $4::text[], $5::int[], $6::text[], $7::timestamptz[], $8::int[],
                $9::text[], $11::int[])
      AS i (id, attempt, outcome, status, error, started, duration, excerpt, bound)
  ), released AS (
    UPDATE runs r SET state = 'queued', not_before = greatest(r.not_before, now()),
                      claimed_by = NULL, claim_expires_at = NULL, max_attempts = r.max_attempts + 1,
                      expiries = r.expiries + (i.bound IS NOT NULL)::int
    FROM input i
    WHERE r.id = i.id AND r.claimed_by = i.node AND r.attempt = i.attempt AND r.state = i.running
      AND (i.bound IS NULL OR r.expiries < i.bound)
    -- The report rides along with its run (see SUCCEED: no second join of input below).
    RETURNING r.id, r.job_id, r.attempt, r.scheduled_for, r.not_before, r.timeout_ms, r.concurrency,
              i.outcome, i.status, i.error, i.started, i.duration, i.excerpt
  ), recorded AS (${recordAttemptOutcomes('d', 'released d')}
  ), announced AS (${announceNextAttempts('d', 'released d', '$10')}
  )
  SELECT id, job_id AS "jobId", attempt, scheduled_for AS "scheduledFor", not_before AS "notBefore",
         timeout_ms AS "timeoutMs", concurrency
  FROM released`;

/** A claim to give back uncalled or with its call aborted (see releaseClaim). */
export interface Release {
  readonly run: { readonly id: string; readonly attempt: number };
  readonly report: AttemptReport;
  /**
   * The hand-back counts as one of the run's forgiven expiries, under this bound (see releaseClaim):
   * not released (null) once the run has that many. Absent: not counted.
   */
  readonly expiryBound?: number;
}

/**
 * Gives back claims of node `nodeId` in one statement, as releaseClaim gives back one: per item,
 * the next attempt's announcement, or null when the claim had been lost (nothing written for it).
 * Everything or nothing is written. `readTimeoutMs`: how long its answer is waited for
 * (withReadTimeout; default the pool's).
 */
export async function releaseClaims(
  db: Queryable,
  nodeId: string,
  items: readonly Release[],
  runsTopic: string,
  readTimeoutMs?: number,
): Promise<(RunMessage | null)[]> {
  if (items.length === 0) return [];
  const sorted = inLockOrder(items, (i) => i.run.id);
  const release = withReadTimeout({ name: 'helios-release-many', text: RELEASE_MANY }, readTimeoutMs);
  const { rows } = await db.query<RequeuedRun>(release, [
    sorted.map((i) => i.run.id),
    nodeId,
    sorted.map((i) => i.run.attempt),
    sorted.map((i) => i.report.outcome),
    sorted.map((i) => i.report.statusCode),
    sorted.map((i) => clean(i.report.error, 2000)),
    sorted.map((i) => i.report.startedAt ?? null),
    sorted.map((i) => (i.report.durationMs === null ? null : Math.round(i.report.durationMs))),
    sorted.map((i) => clean(i.report.responseExcerpt, 64 * 1024)),
    runsTopic,
    sorted.map((i) => i.expiryBound ?? null),
  ]);
  // By run and attempt, as completions: a stale attempt of the same run may share the batch.
  const released = new Map(rows.map((r) => [`${r.id}/${r.attempt}`, r]));
  return items.map((i): RunMessage | null => {
    const row = released.get(`${i.run.id}/${i.run.attempt}`);
    return row ? nextAttemptMessage(row) : null;
  });
}

/**
 * Re-queues runs whose claims are over (claimOver in attempts.ts) without using up an attempt
 * (max_attempts grows by one, as for a claim handed back), counting the expiry, records each
 * expired attempt and announces the next, in one statement: the reaper's forgiveness. Parallel
 * arrays: $1 = run ids, $2 = attempts, $3 = errors; $4 = the forgiven-expiries bound (none for a
 * run whose call never began), $5 = see claimOver, $6 = the runs topic. Returns the runs forgiven,
 * as RequeuedRun.
 */
const FORGIVE_MANY = `
  WITH input AS MATERIALIZED (
    SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[]) AS i (run_id, run_attempt, error)
  ), forgiven AS (
    UPDATE runs SET state = 'queued', not_before = now(), claimed_by = NULL, claim_expires_at = NULL,
                    max_attempts = max_attempts + 1,
                    -- A call that never began is no expiry of a call: it counts nothing against the bound.
                    expiries = expiries + (started_at IS NOT NULL)::int, last_error = i.error
    FROM input i
    WHERE id = i.run_id AND attempt = i.run_attempt AND state = 'running' AND ${claimOver('$5')}
      AND (expiries < $4 OR started_at IS NULL)
    RETURNING id, job_id, attempt, scheduled_for, not_before, timeout_ms, concurrency, i.error
  ), recorded AS (
    UPDATE run_attempts a SET outcome = 'expired', finished_at = now(), status_code = NULL,
                              duration_ms = NULL, error = f.error, response_excerpt = NULL,
                              started_at = least(a.started_at, now())
    FROM forgiven f
    WHERE a.run_id = f.id AND a.attempt = f.attempt AND a.outcome IS NULL
  ), announced AS (${announceNextAttempts('f', 'forgiven f', '$6')}
  )
  SELECT id, job_id AS "jobId", attempt, scheduled_for AS "scheduledFor", not_before AS "notBefore",
         timeout_ms AS "timeoutMs", concurrency
  FROM forgiven`;

/** A run whose claim is over, with the error its expired attempt records. */
export interface Expiry {
  readonly run: { readonly id: string; readonly attempt: number };
  readonly error: string;
}

/**
 * The reaper's answer to claims that are over while each run's forgiven expiries are under
 * `bound`: an expiry means the worker died, froze or lost PostgreSQL, not that the target failed;
 * and the reaper cannot tell whether the call even started (the claim's acknowledgement lost, a
 * worker killed while waiting for an early-claimed run's time): charging an attempt then made a
 * `maxAttempts: 1` run dead with no delivery at all. Past the bound, expiries are charged like
 * failures (failAttempt), so a job whose calls keep killing workers still ends dead. A run claimed
 * ahead whose call never began (see claimOver) is always forgiven and not counted: no call was
 * made, so it brings no later expiry of a call nearer to being charged. Per item, the next attempt's announcement when it was re-queued (null: the bound was reached, or its claim is not over).
 * Call with the runs locked (selectExpiredRuns).
 */
export async function forgiveExpiredClaims(
  db: Queryable,
  items: readonly Expiry[],
  bound: number,
  runsTopic: string,
  options: ExpiryOptions = {},
): Promise<(RunMessage | null)[]> {
  if (items.length === 0) return [];
  const sorted = inLockOrder(items, (i) => i.run.id);
  const { rows } = await db.query<RequeuedRun>({ name: 'helios-forgive-many', text: FORGIVE_MANY }, [
    sorted.map((i) => i.run.id),
    sorted.map((i) => i.run.attempt),
    sorted.map((i) => clean(i.error, 2000)),
    bound,
    options.unstartedAfterMs ?? null,
    runsTopic,
  ]);
  const forgiven = new Map(rows.map((r) => [`${r.id}/${r.attempt}`, r]));
  return items.map((i) => {
    const row = forgiven.get(`${i.run.id}/${i.run.attempt}`);
    return row ? nextAttemptMessage(row) : null;
  });
}
