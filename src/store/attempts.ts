import type pg from 'pg';
import type { RunMessage } from '../model.js';
import { withReadTimeout, type Queryable } from './db.js';
import { buryRun } from './dead-letters.js';
import {
  enqueueAttempt,
  failuresBefore,
  inLockOrder,
  REQUEUED_RUN_COLUMNS,
  type RequeuedRun,
} from './runs.js';

/** How an attempt ended, as recorded in run_attempts.outcome. */
export type AttemptOutcome = 'succeeded' | 'failed' | 'timeout' | 'expired' | 'replaced' | 'cancelled';

/**
 * How a call the worker made (or tried to make) ended: never `expired` (the reaper's) nor `replaced`
 * (a replacement's), which only other writers record.
 */
export type CallOutcome = Exclude<AttemptOutcome, 'expired' | 'replaced'>;

/** What a worker observed during one attempt. */
export interface AttemptReport {
  readonly outcome: AttemptOutcome;
  readonly statusCode: number | null;
  readonly durationMs: number | null;
  readonly error: string | null;
  readonly responseExcerpt: string | null;
  /**
   * False when trying again cannot help (the target policy refused the URL or its address): the
   * run is dead at once, whatever attempts are left. Absent means true.
   */
  readonly retryable?: boolean;
  /**
   * When the call began, by the worker's estimate of the database clock (never recorded later than
   * the write's own now(): the estimate may be off by the skew tolerance). Absent (no call made,
   * or the reaper): the attempt's started_at stays as its claim set it, the later of the claim and
   * the run's due time, which is earlier than the call when a run claimed ahead waited for a slot.
   */
  readonly startedAt?: Date;
}

/** Who may settle an attempt: the claimant (node id), or the reaper once the claim expired. */
export type Settler = { readonly nodeId: string } | { readonly reaper: true };

// PostgreSQL text cannot hold NUL; a response body or error message may.
export const clean = (text: string | null, max: number) =>
  text === null ? null : text.replaceAll('\u0000', '').slice(0, max);

/**
 * Records an attempt's outcome unless one was recorded already (the reaper or a replace).
 * $1 = run id, $2 = attempt, $3 = outcome, $4 = status, $5 = duration ms, $6 = error, $7 = excerpt,
 * $8 = when the call began (NULL: the claim's start stands).
 */
const RECORD_ATTEMPT = `
  UPDATE run_attempts SET outcome = $3, finished_at = now(), status_code = $4, duration_ms = $5,
                          error = $6, response_excerpt = $7,
                          started_at = least(coalesce($8::timestamptz, started_at), now())
  WHERE run_id = $1 AND attempt = $2 AND outcome IS NULL`;

async function recordAttempt(db: Queryable, runId: string, attempt: number, report: AttemptReport) {
  await db.query(RECORD_ATTEMPT, [
    runId,
    attempt,
    report.outcome,
    report.statusCode,
    report.durationMs === null ? null : Math.round(report.durationMs),
    clean(report.error, 2000),
    clean(report.responseExcerpt, 64 * 1024),
    report.startedAt ?? null,
  ]);
}

/**
 * Marks runs succeeded where node $6 still holds the attempt, and records the attempts, in one
 * statement. Parallel arrays: $1 = run ids, $2 = attempts, $3 = statuses, $4 = durations ms,
 * $5 = response excerpts, $7 = when each call began. Returns the ids that were completed.
 * finished_at is when the call ended (its start plus its duration, by the worker's
 * estimate of this clock), not when this write ran: a worker may hold a success's write back for
 * up to HELIOS_COMPLETION_HOLD_MS while its other calls are underway (execution/batching.ts).
 */
const SUCCEED = `
  WITH input AS MATERIALIZED (
    -- node and state ride along as columns of a materialised input, so the conditions on them
    -- below are join conditions, not conditions of the scan of runs that the planner estimates
    -- from the statistics: taken while every run was queued (no claimed_by, none running, as
    -- autovacuum does seconds after a herd is dispatched), those said the conditions match
    -- nothing, and the plan scanned the whole table once per batch (960 ms for 256 runs of
    -- 10,000) instead of one primary-key lookup per run. A non-constant state test also keeps the
    -- planner from proving runs_running_idx's predicate (42 ms per batch with 5,000 running).
    SELECT i.*, $6::text AS node, 'running'::text AS running
    FROM unnest($1::uuid[], $2::int[], $3::int[], $4::int[], $5::text[], $7::timestamptz[])
      AS i (id, attempt, status, duration, excerpt, started)
  ), done AS (
    UPDATE runs r SET state = 'succeeded', claim_expires_at = NULL,
                      finished_at = least(coalesce(i.started + i.duration * interval '1 millisecond', now()), now()),
                      last_status = i.status, last_error = NULL,
                      -- The run started with its first call (a run claimed ahead may have waited
                      -- for a slot after the instant its claim recorded).
                      started_at = CASE WHEN r.attempt = 1 THEN least(coalesce(i.started, r.started_at), now())
                                        ELSE r.started_at END
    FROM input i
    WHERE r.id = i.id AND r.claimed_by = i.node AND r.attempt = i.attempt AND r.state = i.running
    -- Each completed run carries the report of the input row it was completed with (joined on the
    -- attempt too: a stale completion of the same run, its attempt 1 after the reaper took it back
    -- and this node claimed attempt 2, can share a batch with the current one and must not lend
    -- the current attempt its report). Joining input again below instead was planned, for the
    -- generic plan's estimate of one row per side, as a nested loop rescanning input for every
    -- completed run: O(batch²), 15 of a 256-run batch's 20 ms.
    RETURNING r.id, r.attempt, i.status, i.duration, i.excerpt, i.started, r.finished_at AS ended
  ), recorded AS (
    UPDATE run_attempts a SET outcome = 'succeeded', finished_at = d.ended, status_code = d.status,
                              duration_ms = d.duration, response_excerpt = d.excerpt,
                              started_at = least(coalesce(d.started, a.started_at), now())
    FROM done d
    WHERE a.run_id = d.id AND a.attempt = d.attempt
  )
  SELECT id, attempt FROM done`;

/** A successful attempt to record. */
export interface Success {
  readonly run: { readonly id: string; readonly attempt: number };
  readonly report: AttemptReport;
}

/**
 * Completes successful attempts of node `nodeId` in one statement; returns, per item, false when
 * the claim had been lost (the completion is stale and was discarded). `readTimeoutMs`: how long
 * its answer is waited for (withReadTimeout; default the pool's).
 */
export async function completeSucceededMany(
  db: Queryable,
  nodeId: string,
  items: readonly Success[],
  readTimeoutMs?: number,
): Promise<boolean[]> {
  if (items.length === 0) return [];
  const sorted = inLockOrder(items, (i) => i.run.id);
  // Named: parsed and planned once per connection (see claimRuns).
  const { rows } = await db.query<{ id: string; attempt: number }>(
    withReadTimeout({ name: 'helios-complete-succeeded', text: SUCCEED }, readTimeoutMs),
    [
      sorted.map((i) => i.run.id),
      sorted.map((i) => i.run.attempt),
      sorted.map((i) => i.report.statusCode),
      sorted.map((i) => (i.report.durationMs === null ? null : Math.round(i.report.durationMs))),
      sorted.map((i) => clean(i.report.responseExcerpt, 64 * 1024)),
      nodeId,
      sorted.map((i) => i.report.startedAt ?? null),
    ],
  );
  // By run and attempt: only the item whose attempt was completed is settled.
  const done = new Set(rows.map((r) => `${r.id}/${r.attempt}`));
  return items.map((i) => done.has(`${i.run.id}/${i.run.attempt}`));
}

/** Completes one successful attempt; false when the claim had been lost. */
export async function completeSucceeded(
  db: Queryable,
  run: { id: string; attempt: number },
  nodeId: string,
  report: AttemptReport,
): Promise<boolean> {
  const [done] = await completeSucceededMany(db, nodeId, [{ run, report }]);
  return done ?? false;
}

/**
 * Ends a failed attempt: back to `queued` after $4 ms, or `dead` when no attempt is left or $7
 * (not retryable). $1 = run id, $2 = attempt, $3 = claimant node id (NULL: the reaper, which may
 * only take a run whose claim has expired), $4 = retry delay ms, $5 = status, $6 = error,
 * $8 = when the call began (NULL: the claim's start stands).
 */
const FAIL = `
  UPDATE runs SET
    state = CASE WHEN attempt >= max_attempts OR $7 THEN 'dead' ELSE 'queued' END,
    not_before = CASE WHEN attempt >= max_attempts OR $7 THEN not_before
                      ELSE now() + $4 * interval '1 millisecond' END,
    finished_at = CASE WHEN attempt >= max_attempts OR $7 THEN now() END,
    claimed_by = NULL, claim_expires_at = NULL, last_status = $5, last_error = $6,
    started_at = CASE WHEN attempt = 1 THEN least(coalesce($8::timestamptz, started_at), now()) ELSE started_at END
  WHERE id = $1 AND attempt = $2 AND state = 'running'
    AND (claimed_by = $3 OR ($3::text IS NULL AND claim_expires_at < now()))
  RETURNING state, ${REQUEUED_RUN_COLUMNS}`;

/** Where retries and dead letters are announced. */
export interface Topics {
  readonly runsTopic: string;
  readonly deadLetterTopic: string;
}

/** What became of a failed attempt; null when the claim was lost (stale, nothing written). */
export type FailureResult = { state: 'queued'; notBefore: Date } | { state: 'dead'; deadLetterId: string };

/**
 * The outcome recorded on one node's attempt of a run, and whether the run still exists.
 * $1 = run id, $2 = attempt, $3 = node id.
 */
const ATTEMPT_OUTCOME = `
  SELECT (SELECT outcome FROM run_attempts WHERE run_id = $1 AND attempt = $2 AND node_id = $3) AS outcome,
         NOT EXISTS (SELECT 1 FROM runs WHERE id = $1) AS "runGone"`;

/**
 * The outcome recorded on `nodeId`'s attempt `attempt` of a run: null while none is (or when the
 * attempt is not that node's). A settle write retried after an error can find its claim settled
 * by its own earlier try, whose statement committed and whose answer was lost; this tells that
 * apart from a claim the reaper took back (`expired`). `runGone`: the run no longer exists (its
 * job was deleted), so no one calls it again.
 */
export async function attemptOutcome(
  db: Queryable,
  runId: string,
  attempt: number,
  nodeId: string,
): Promise<{ outcome: string | null; runGone: boolean }> {
  const { rows } = await db.query<{ outcome: string | null; runGone: boolean }>(ATTEMPT_OUTCOME, [
    runId,
    attempt,
    nodeId,
  ]);
  return { outcome: rows[0]?.outcome ?? null, runGone: rows[0]?.runGone ?? false };
}

/**
 * Settles a failed attempt inside the caller's transaction: retry (runs row, attempt record and
 * an outbox row with publish_after = not_before) or dead (plus dead_letters and a DLQ outbox row).
 * Everything or nothing is written, so a retry survives any restart.
 */
export async function failAttempt(
  client: pg.PoolClient,
  run: { id: string; attempt: number },
  settler: Settler,
  report: AttemptReport,
  retryDelayMs: number,
  topics: Topics,
): Promise<FailureResult | null> {
  const nodeId = 'nodeId' in settler ? settler.nodeId : null;
  const error = clean(report.error, 2000);
  const { rows } = await client.query<RequeuedRun & { state: 'queued' | 'dead' }>(FAIL, [
    run.id,
    run.attempt,
    nodeId,
    Math.max(0, Math.round(retryDelayMs)),
    report.statusCode,
    error,
    report.retryable === false,
    report.startedAt ?? null,
  ]);
  const row = rows[0];
  if (!row) return null;
  await recordAttempt(client, run.id, run.attempt, report);
  if (row.state === 'dead') {
    const deadLetterId = await buryRun(client, row, { error, statusCode: report.statusCode }, topics);
    return { state: 'dead', deadLetterId };
  }
  await enqueueAttempt(client, row, topics.runsTopic);
  return { state: 'queued', notBefore: row.notBefore };
}

/**
 * Takes a key-share lock on those of jobs $1 that no one holds more strongly (a pause, an edit or
 * a delete holds its job's row while it waits for the job's runs): a dead letter's foreign key
 * needs it, and a batch that waited for it while holding its other runs' rows closed a cycle with
 * such a command. Returns the ids locked.
 */
const LOCK_FREE_JOBS = `SELECT id FROM jobs WHERE id = ANY($1::uuid[]) ORDER BY id FOR KEY SHARE SKIP LOCKED`;

export async function lockFreeJobs(client: pg.PoolClient, jobIds: readonly string[]): Promise<Set<string>> {
  const { rows } = await client.query<{ id: string }>(LOCK_FREE_JOBS, [jobIds]);
  return new Set(rows.map((r) => r.id));
}

/** An ISO-8601 UTC timestamp with milliseconds, as `Date.prototype.toISOString` writes it (SQL). */
export const isoMs = (column: string) =>
  `to_char(${column} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')`;

/**
 * The attempts' records of settled runs `alias` (SQL: an UPDATE for a CTE, over `from`, whose rows
 * carry id, attempt and the report's outcome, status, duration, error, excerpt and started), as
 * RECORD_ATTEMPT writes one: unless one was recorded already (the reaper or a replace).
 */
export const recordAttemptOutcomes = (alias: string, from: string) => `
    UPDATE run_attempts a SET outcome = ${alias}.outcome, finished_at = now(), status_code = ${alias}.status,
                              duration_ms = ${alias}.duration, error = ${alias}.error,
                              response_excerpt = ${alias}.excerpt,
                              started_at = least(coalesce(${alias}.started, a.started_at), now())
    FROM ${from}
    WHERE a.run_id = ${alias}.id AND a.attempt = ${alias}.attempt AND a.outcome IS NULL`;

/**
 * The outbox rows announcing the next attempts of re-queued runs `alias` (SQL: an INSERT for a
 * CTE, over `from`; `topic` an expression), the rows enqueueAttempt writes: the same keys, and
 * timestamps as JSON.stringify writes a Date.
 */
export const announceNextAttempts = (alias: string, from: string, topic: string) => `
    INSERT INTO outbox (topic, key, payload, publish_after)
    SELECT ${topic}, ${alias}.job_id::text,
           jsonb_build_object('runId', ${alias}.id, 'jobId', ${alias}.job_id, 'attempt', ${alias}.attempt + 1,
                              'scheduledFor', ${isoMs(`${alias}.scheduled_for`)},
                              'notBefore', ${isoMs(`${alias}.not_before`)},
                              'timeoutMs', ${alias}.timeout_ms, 'concurrency', ${alias}.concurrency),
           ${alias}.not_before
    FROM ${from}`;

/**
 * FAIL, the attempt's record, and the retry's announcement or the dead letter and its announcement
 * (failAttempt, buryRun, enqueueAttempt), for many failed attempts of node $2 in one statement.
 * Parallel arrays: $1 = run ids, $3 = attempts, $4 = retry delays ms, $5 = statuses, $6 = errors,
 * $7 = not retryable, $8 = when each call began, $9 = outcomes, $10 = durations ms,
 * $11 = response excerpts; $12 = the runs topic, $13 = the dead-letter topic. The announcements
 * are those the single path writes (the same keys, and timestamps as JSON.stringify writes a Date).
 * $14 = retries only: a run this failure would bury is left as it is (not returned), so the
 * statement takes no lock on any job (a dead letter's foreign key takes one on its job's row).
 * Returns the runs whose claim node $2 still held: their new state, the retry's not_before or the
 * dead letter's id.
 */
const FAIL_MANY = `
  WITH input AS MATERIALIZED (
    -- Node and state ride along as columns of a materialised input, as in SUCCEED (one
    -- primary-key lookup per run, whatever the statistics say).
    SELECT i.*, $2::text AS node, 'running'::text AS running
    FROM unnest($1::uuid[], $3::int[], $4::int[], $5::int[], $6::text[], $7::bool[], $8::timestamptz[],
                $9::text[], $10::int[], $11::text[])
      AS i (id, attempt, delay, status, error, final, started, outcome, duration, excerpt)
  ), failed AS (
    UPDATE runs r SET
      state = CASE WHEN r.attempt >= r.max_attempts OR i.final THEN 'dead' ELSE 'queued' END,
      not_before = CASE WHEN r.attempt >= r.max_attempts OR i.final THEN r.not_before
                        ELSE now() + i.delay * interval '1 millisecond' END,
      finished_at = CASE WHEN r.attempt >= r.max_attempts OR i.final THEN now() END,
      claimed_by = NULL, claim_expires_at = NULL, last_status = i.status, last_error = i.error,
      started_at = CASE WHEN r.attempt = 1 THEN least(coalesce(i.started, r.started_at), now())
                        ELSE r.started_at END
    FROM input i
    WHERE r.id = i.id AND r.claimed_by = i.node AND r.attempt = i.attempt AND r.state = i.running
      AND NOT ($14 AND (r.attempt >= r.max_attempts OR i.final))
    -- The report rides along with the run it settled (see SUCCEED: joining input again below
    -- was planned as a nested loop over the whole batch per run).
    -- A dead run's letter gets its id here, so that the letter and its announcement below are
    -- both made from this CTE alone: joining CTEs (each estimated at one row) was planned as a
    -- nested loop rescanning one per row of the other, O(batch²) (test/integration/store-plans).
    RETURNING r.id, r.job_id, r.attempt, r.state, r.scheduled_for, r.not_before, r.timeout_ms,
              r.concurrency, i.status, i.error, i.started, i.outcome, i.duration, i.excerpt,
              CASE WHEN r.state = 'dead' THEN gen_random_uuid() END AS letter_id
  ), recorded AS (${recordAttemptOutcomes('f', 'failed f')}
  ), retried AS (${announceNextAttempts('f', "failed f WHERE f.state = 'queued'", '$12')}
  ), buried AS (
    -- created_at is now(), as the letter's announcement says (deadAt).
    INSERT INTO dead_letters (id, run_id, job_id, attempt, error, status_code, created_at)
    SELECT f.letter_id, f.id, f.job_id, f.attempt, f.error, f.status, now() FROM failed f WHERE f.state = 'dead'
  ), announced AS (
    INSERT INTO outbox (topic, key, payload)
    SELECT $13, f.job_id::text,
           jsonb_build_object('deadLetterId', f.letter_id, 'runId', f.id, 'jobId', f.job_id,
                              'attempt', f.attempt, 'scheduledFor', ${isoMs('f.scheduled_for')},
                              'error', f.error, 'statusCode', f.status, 'deadAt', ${isoMs('now()')})
    FROM failed f WHERE f.state = 'dead'
  )
  SELECT id, attempt, state, not_before AS "notBefore", letter_id AS "deadLetterId" FROM failed`;

/** A failed attempt to settle (see failAttempt). */
export interface Failure {
  readonly run: {
    readonly id: string;
    readonly attempt: number;
    readonly jobId: string;
    readonly maxAttempts: number;
  };
  readonly report: AttemptReport;
  /** When the run's next attempt is due, if it has one left: this long from now. */
  readonly retryDelayMs: number;
}

/**
 * Settles failed attempts of node `nodeId` in one statement, as failAttempt settles one: per item,
 * what became of it, or null when the claim had been lost (nothing written for it). Everything
 * or nothing is written. With `retriesOnly`, null also for a run the failure would bury (see
 * FAIL_MANY): the caller settles those otherwise. `readTimeoutMs`: how long its answer is waited
 * for (withReadTimeout; default the pool's).
 */
export async function failMany(
  db: Queryable,
  nodeId: string,
  items: readonly Failure[],
  topics: Topics,
  options: { retriesOnly?: boolean; readTimeoutMs?: number } = {},
): Promise<(FailureResult | null)[]> {
  if (items.length === 0) return [];
  const sorted = inLockOrder(items, (i) => i.run.id);
  const { rows } = await db.query<{
    id: string;
    attempt: number;
    state: 'queued' | 'dead';
    notBefore: Date;
    deadLetterId: string | null;
  }>(withReadTimeout({ name: 'helios-fail-many', text: FAIL_MANY }, options.readTimeoutMs), [
    sorted.map((i) => i.run.id),
    nodeId,
    sorted.map((i) => i.run.attempt),
    sorted.map((i) => Math.max(0, Math.round(i.retryDelayMs))),
    sorted.map((i) => i.report.statusCode),
    sorted.map((i) => clean(i.report.error, 2000)),
    sorted.map((i) => i.report.retryable === false),
    sorted.map((i) => i.report.startedAt ?? null),
    sorted.map((i) => i.report.outcome),
    sorted.map((i) => (i.report.durationMs === null ? null : Math.round(i.report.durationMs))),
    sorted.map((i) => clean(i.report.responseExcerpt, 64 * 1024)),
    topics.runsTopic,
    topics.deadLetterTopic,
    options.retriesOnly ?? false,
  ]);
  // By run and attempt, as completions: a stale attempt of the same run may share the batch.
  const settled = new Map(rows.map((r) => [`${r.id}/${r.attempt}`, r]));
  return items.map((i): FailureResult | null => {
    const row = settled.get(`${i.run.id}/${i.run.attempt}`);
    if (!row) return null;
    return row.state === 'dead'
      ? { state: 'dead', deadLetterId: row.deadLetterId! }
      : { state: 'queued', notBefore: row.notBefore };
  });
}

/**
 * Gives a claimed run back (shutdown aborted its call, or it did not start: too little time left):
 * queued again without using up an attempt (max_attempts grows by one), due when it was due (a run
 * claimed ahead of its time must not be called early by the next worker) or at once.
 * $1 = run id, $2 = node id, $3 = attempt, $4 = see releaseClaim's `expiryBound` (NULL: none).
 */
const RELEASE = `
  UPDATE runs SET state = 'queued', not_before = greatest(not_before, now()),
                  claimed_by = NULL, claim_expires_at = NULL, max_attempts = max_attempts + 1,
                  expiries = expiries + ($4::int IS NOT NULL)::int
  WHERE id = $1 AND claimed_by = $2 AND attempt = $3 AND state = 'running'
    AND ($4::int IS NULL OR expiries < $4::int)
  RETURNING ${REQUEUED_RUN_COLUMNS}`;

/**
 * Returns the next attempt's announcement, or null when the claim was already lost. With
 * `expiryBound`, the hand-back counts as one of the run's forgiven expiries (forgiveExpiredClaims in
 * releases.ts): null too, nothing written, when the run has `expiryBound` already (charge the
 * attempt then, failAttempt, which is null in turn when the claim was lost).
 */
export async function releaseClaim(
  client: pg.PoolClient,
  run: { id: string; attempt: number },
  nodeId: string,
  report: AttemptReport,
  runsTopic: string,
  expiryBound?: number,
): Promise<RunMessage | null> {
  const params = [run.id, nodeId, run.attempt, expiryBound ?? null];
  return requeueUncharged(client, RELEASE, params, run, report, runsTopic);
}

/**
 * Runs `sql` (an UPDATE that puts a running run back to `queued` without using up an attempt and
 * RETURNS it as a {@link RequeuedRun}), then records the attempt's outcome and announces the next
 * attempt. Returns that announcement; null when the UPDATE matched nothing (the claim was lost
 * meanwhile).
 */
async function requeueUncharged(
  client: pg.PoolClient,
  sql: string,
  params: unknown[],
  run: { id: string; attempt: number },
  report: AttemptReport,
  runsTopic: string,
): Promise<RunMessage | null> {
  const { rows } = await client.query<RequeuedRun>(sql, params);
  const row = rows[0];
  if (!row) return null;
  await recordAttempt(client, run.id, run.attempt, report);
  return enqueueAttempt(client, row, runsTopic);
}

/**
 * A claim is over (SQL, a condition on `runs`): past its deadline; or a run claimed ahead of its
 * time whose call has not begun (started_at NULL: START, runs.ts, comes right before the call) `$n`
 * ms after it fell due. A worker calls a run claimed ahead only within its claim grace of the due
 * time (attempt.ts hands a later one back, claim-too-late), so such a claim belongs to a worker
 * that died, froze or lost PostgreSQL before the call, and no call was made for it: a herd's runs
 * claimed ahead by a worker killed just before it were otherwise late by their timeout and grace
 * (35 s by default, an hour for the longest timeouts). A START racing this waits for the row and
 * finds the claim gone, or commits first and the run is no longer unstarted. NULL `$n`: only the
 * deadline.
 */
export const claimOver = (unstartedAfter: string) => `
  (claim_expires_at < now()
   OR (${unstartedAfter}::int IS NOT NULL AND started_at IS NULL
       AND not_before < now() - ${unstartedAfter}::int * interval '1 millisecond'))`;

/** A run whose claim expired, locked for the reaper. */
export interface ExpiredRun {
  readonly id: string;
  readonly attempt: number;
  readonly claimedBy: string | null;
  readonly backoffMs: number;
  readonly backoffMultiplier: number;
  /** Calls of this run the target failed before this attempt, since its last replay (failuresBefore in runs.ts). */
  readonly failuresBefore: number;
  /** Earlier expiries of this run that were forgiven (see forgiveExpiredClaims in releases.ts). */
  readonly expiries: number;
  /** Claimed ahead and its call never began (see claimOver). */
  readonly unstarted: boolean;
}

/** When the reaper takes a claim back. */
export interface ExpiryOptions {
  /**
   * Also a run claimed ahead whose call has not begun this long after its due time (see claimOver):
   * the workers' claim grace (HELIOS_CLAIM_GRACE_MS). Default: only claims past their deadline.
   */
  readonly unstartedAfterMs?: number;
}

/** What the reaper reads of a run (SQL, `runs r`). */
const EXPIRED_COLUMNS = `r.id, r.attempt, r.claimed_by AS "claimedBy", r.backoff_ms AS "backoffMs",
  r.backoff_multiplier AS "backoffMultiplier", ${failuresBefore('r')} AS "failuresBefore", r.expiries,
  r.started_at IS NULL AS unstarted`;

/**
 * A key-share lock on run r's job, SKIP LOCKED (SQL, a condition). A run whose job a command holds
 * (a pause, an edit or a delete: findJob ... FOR UPDATE, for up to its lock patience) is left to a
 * later pass, like a run another transaction holds: burying it writes a dead letter, whose foreign
 * key waits for that job's row, and the pass would wait with every other run it took still
 * locked. Tried in a filter, before the run is locked: as a second locking clause of a join it
 * locked (and kept locked) every expired run of a held job on every pass, and the join was
 * planned as a sort of all expired runs.
 */
const jobFree = (run: string) =>
  `EXISTS (SELECT FROM jobs j WHERE j.id = ${run}.job_id FOR KEY SHARE SKIP LOCKED)`;
const JOB_FREE = jobFree('r');

/**
 * Running runs whose claims are over (claimOver), locked, with their jobs key-share locked
 * (JOB_FREE): first those past their deadline, oldest first (an ordered scan of
 * runs_running_idx), at most $1; then, if those were fewer than $1, at most $3 runs claimed ahead
 * whose call has not begun $2 ms after they fell due, found by scanning the running runs (a
 * second's claims ahead: a few thousand in a herd), in no order. NULL $2: only the
 * first. The second kind is re-queued in one statement whatever their number (a run past its
 * deadline may be charged, one transaction's statements each), so it may take more per pass: a
 * worker killed before a herd left 3,264 of them; at 100 a pass the last was called 6.6 s after
 * due, at 1,000 a pass 5.8–6.3 s (`bench/stop-in-herd.ts --signal SIGKILL`).
 */
const SELECT_EXPIRED = `
  WITH past_deadline AS (
    SELECT ${EXPIRED_COLUMNS}
    FROM runs r
    WHERE r.state = 'running' AND r.claim_expires_at < now() AND ${JOB_FREE}
    ORDER BY r.claim_expires_at
    LIMIT $1
    FOR UPDATE OF r SKIP LOCKED
  ), never_started AS (
    -- The candidates first, in no order: all of them go within a few passes, and an order by
    -- claim_expires_at was planned as a sort of every running run once the limit was a large part
    -- of them; below such a sort, the job filter locked the job of every never-started run (10,000
    -- after a herd's worker died) on each pass. Unsorted, the scan stops at the limit, and the
    -- filter skips the runs of held jobs before they count against it: otherwise runs of jobs
    -- that commands hold, ahead in the scan, kept the others from ever being taken.
    -- The candidates in an array, which the running runs are matched against: the array's
    -- subquery runs once, whatever the plan around it. As "r.id IN (subquery)", with statistics
    -- taken while every run was queued (an autovacuum analyze between a herd's dispatch and its
    -- claims), the planner estimated one running run and ran the subquery again for each running
    -- run it scanned: 8,000 runs claimed ahead took 12 s, holding the fence row
    -- (inFencedTransaction) and with it every dispatch pass.
    SELECT ${EXPIRED_COLUMNS}
    FROM runs r
    WHERE r.id = ANY (ARRAY(
        SELECT c.id FROM runs c
        WHERE $2::int IS NOT NULL AND (SELECT count(*) FROM past_deadline) < $1
          AND c.state = 'running' AND c.started_at IS NULL AND c.claim_expires_at >= now()
          AND c.not_before < now() - $2::int * interval '1 millisecond' AND ${jobFree('c')}
        LIMIT $3))
      -- Their jobs were key-share locked by the candidates' filter (row locks last until the end
      -- of the transaction). Not again here: a join that scans the running runs would lock the
      -- job of every one of them (planned as a hash join, 1,000 jobs for 100 runs taken).
      AND r.state = 'running' AND r.started_at IS NULL
    FOR UPDATE OF r SKIP LOCKED
  )
  SELECT * FROM past_deadline UNION ALL SELECT * FROM never_started`;

export async function selectExpiredRuns(
  db: Queryable,
  limit: number,
  options: ExpiryOptions & { readonly unstartedLimit?: number } = {},
): Promise<ExpiredRun[]> {
  const { rows } = await db.query<ExpiredRun>(SELECT_EXPIRED, [
    limit,
    options.unstartedAfterMs ?? null,
    options.unstartedLimit ?? limit,
  ]);
  return rows;
}

/**
 * Milliseconds until the earliest claim is over (see claimOver; database clock); null if nothing
 * runs. $1 = see claimOver.
 */
const NEXT_EXPIRY = `
  SELECT (extract(epoch FROM least(
            min(claim_expires_at),
            min(not_before) FILTER (WHERE started_at IS NULL) + $1::int * interval '1 millisecond'
          ) - now()) * 1000)::float8 AS "inMs"
  FROM runs WHERE state = 'running'`;

export async function msUntilNextExpiry(db: Queryable, options: ExpiryOptions = {}): Promise<number | null> {
  const { rows } = await db.query<{ inMs: number | null }>(NEXT_EXPIRY, [options.unstartedAfterMs ?? null]);
  return rows[0]?.inMs ?? null;
}
