import type { ConcurrencyPolicy, RunMessage, RunTarget } from '../model.js';
import { withReadTimeout, type Queryable } from './db.js';

/** A run this node has claimed: everything needed to execute the attempt and settle it. */
export interface ClaimedRun {
  readonly id: string;
  readonly jobId: string;
  /** The attempt this claim is (1 = first); completion is conditional on it. */
  readonly attempt: number;
  readonly maxAttempts: number;
  /** Calls of this run the target failed before this attempt, since its last replay ({@link failuresBefore}). */
  readonly failuresBefore: number;
  readonly scheduledFor: Date;
  readonly target: RunTarget;
  readonly timeoutMs: number;
  readonly backoffMs: number;
  readonly backoffMultiplier: number;
  readonly concurrency: ConcurrencyPolicy;
  /** When the call may start: a run claimed ahead (see ClaimOptions.leadMs) waits until then. */
  readonly notBefore: Date;
  readonly claimExpiresAt: Date;
  /**
   * Claimed before its time (its first call not yet made): a pause or an edit may still withdraw
   * it, so the call waits for {@link startRuns} to mark it started.
   */
  readonly startPending: boolean;
}

/**
 * How many calls of run `r` (SQL) the target failed (non-2xx, timeout) before its current attempt,
 * since its last replay: the run's retry back-off counts these (the n-th failure waits backoffMs ×
 * multiplier^(n − 1)), not its attempt numbers. A replay gives the run a fresh budget of attempts,
 * and with it a fresh back-off: counted by attempt number, a replayed run's first retry of a job
 * with 5 attempts, 1 min and ×2 waited 32 min. A claim handed back or forgiven (no call failed)
 * takes an attempt number too. 0 for a first attempt without a look at any table.
 */
export const failuresBefore = (r: string) => `
  CASE WHEN ${r}.attempt <= 1 THEN 0 ELSE (
    SELECT count(*)::int FROM run_attempts a
    WHERE a.run_id = ${r}.id AND a.attempt < ${r}.attempt AND a.outcome IN ('failed', 'timeout')
      AND a.attempt > (SELECT coalesce(max(d.attempt), 0) FROM dead_letters d
                       WHERE d.run_id = ${r}.id AND d.replayed_at IS NOT NULL)) END`;

const CLAIMED_COLUMNS = `
  id, job_id AS "jobId", attempt, max_attempts AS "maxAttempts",
  ${failuresBefore('claimed')} AS "failuresBefore", scheduled_for AS "scheduledFor",
  target, timeout_ms AS "timeoutMs", backoff_ms AS "backoffMs",
  backoff_multiplier AS "backoffMultiplier", concurrency, not_before AS "notBefore",
  claim_expires_at AS "claimExpiresAt", started_at IS NULL AS "startPending"`;

/**
 * Whether queued run `r` (SQL) is a misfire its job's policy drops when a worker comes to claim it
 * (`threshold`, SQL: milliseconds, NULL for never): a scheduled occurrence that a leader created,
 * that no worker claimed, that is due (or, made late by a catch-up, was made) more than the
 * threshold ago, and whose leader's epoch has ended since (a newer epoch has written: the cluster
 * was leaderless, or down, in between), of a `skip` job, or of a `fire-once` job with a later
 * occurrence that is late too, made into a run or still to be (that one fires: one run for the
 * latest missed occurrence, whichever of the
 * workers and the new leader comes first). Its epoch has ended when the fence has moved past it, or
 * when etcd says so (`ended`, SQL: every epoch with a token below `below` has ended, read from the
 * leader key `leaderKey` names, which must be the one the fence's token is of; NULL: unknown; see
 * EndedEpochsReading): the fence moves only at a new epoch's first write, and a worker back after
 * the whole cluster was down, before any leader has written, would run such runs late. The policy
 * is the run's copy of its job's (an edit changes it only for occurrences after the edit's line:
 * jobs.ts recopyMisfire; the job's for runs created before runs had the column). The dispatcher and
 * a command's createDueRuns apply the policy to occurrences they find late, and the runs they make
 * late are theirs to fire; this covers the runs a leader made ahead, in time, before the cluster
 * went down. A run merely delayed while its leader stays (a worker blocked, Kafka away, a
 * saturated cluster) is delayed, never dropped (contract item 5); nor is a run a worker had
 * claimed (attempt > 0: a retry, a replay, a claim handed back or forgiven) or a manual run. Cheap
 * tests first: the fence, jobs and runs lookups are made only for a late, never-claimed run.
 * Always true or false, never NULL.
 */
export const misfiredAtClaim = (
  r: string,
  threshold: string,
  ended: { below: string; leaderKey: string },
): string => {
  const late = `statement_timestamp() - ${threshold}::int * interval '1 millisecond'`;
  // IS TRUE: a run made through the API has no created_epoch, and NULL here would leave it
  // unclaimed for ever (NOT NULL is not true).
  return `((
  ${threshold}::int IS NOT NULL AND ${r}.attempt = 0 AND ${r}.trigger = 'schedule'
  AND greatest(${r}.scheduled_for, ${r}.created_at) < ${late}
  AND ${r}.created_epoch < (
    SELECT greatest(f.token, CASE WHEN f.leader_key = ${ended.leaderKey}::text THEN ${ended.below}::bigint END)
    FROM leader_fence f WHERE f.id)
  AND EXISTS (
    SELECT 1 FROM jobs j
    WHERE j.id = ${r}.job_id AND (coalesce(${r}.misfire, j.misfire) = 'skip' OR (coalesce(${r}.misfire, j.misfire) = 'fire-once' AND (
      -- The new leader has yet to create the later occurrences missed (next_run_at is the first
      -- not made into a run, after every run's): it fires the latest of them, unless paused or
      -- now \`skip\`.
      (j.enabled AND j.misfire <> 'skip' AND j.next_run_at < ${late})
      -- A later late occurrence's run that fires in this one's place: not one that copied \`skip\`.
      OR EXISTS (
        SELECT 1 FROM runs later
        WHERE later.job_id = ${r}.job_id AND later.trigger = 'schedule' AND later.scheduled_for > ${r}.scheduled_for
          AND later.scheduled_for < ${late} AND coalesce(later.misfire, j.misfire) <> 'skip'))))))
  IS TRUE)`;
};

/**
 * Whether the job of run `r` (SQL), as it is now, keeps its runs apart: `forbid`, or `replace`
 * (whose newer run fails an older one rather than run beside it). Only then does a `forbid` run
 * wait for a running sibling that copied another policy: that wait is for an edit to `forbid`
 * during an `allow` call. Once the job is `allow` again, its new runs may keep one of them running
 * at all times (an every-second job whose calls take longer than a second), and a `forbid` retry or
 * replay from before the edit that waited for them never started (contract item 10: it waits its
 * turn; the job no longer forbids anything). It still waits for a sibling that copied `forbid`.
 */
const jobKeepsRunsApart = (r: string): string =>
  `EXISTS (SELECT 1 FROM jobs j WHERE j.id = ${r}.job_id AND j.concurrency <> 'allow')`;

/**
 * {@link jobKeepsRunsApart} as a claim must read it: the job row as last committed, locked (KEY
 * SHARE) until the claim commits. No write of `runs` stands between the claim and an edit of the
 * job, so the statement's snapshot alone let a claim that took it before an edit from `allow` to
 * `forbid` committed, and then waited for the run's row (held by the polling fallback's SELECT),
 * call a `forbid` retry beside the `allow` call in flight after the edit had answered. Locked, an
 * edit committed since the snapshot is read (READ COMMITTED rechecks the newest row), and an edit
 * that comes later waits for the claim (findJob ... FOR UPDATE), so the claim is before its line.
 * A row a command or the dispatcher holds is not waited for (the claim may hold other runs of the
 * job a command waits for: jobs.ts YIELD_AFTER_MS); the run then waits as if the job kept its
 * runs apart, which is what its copy of `forbid` says (a fresh occurrence is skipped beside the
 * running run, a retry is tried again).
 */
const jobKeepsRunsApartLocked = (r: string): string =>
  `NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = ${r}.job_id AND j.concurrency = 'allow'
               FOR KEY SHARE OF j SKIP LOCKED)`;

/**
 * Whether running run `o` (SQL) keeps `r`, a queued `forbid` run of its job, from starting: `o`
 * copied `forbid` (runs_forbid_one_running_idx: two such never run at once), or the job keeps its
 * runs apart ({@link jobKeepsRunsApart}, looked up only for a sibling that copied another policy;
 * `locked`: {@link jobKeepsRunsApartLocked}, as the claim reads it).
 */
const keepsForbidRunWaiting = (o: string, r: string, locked = false): string =>
  `(${o}.concurrency = 'forbid' OR ${locked ? jobKeepsRunsApartLocked(r) : jobKeepsRunsApart(r)})`;

/**
 * Whether `r` (SQL) is a `forbid` run another run of its job keeps from starting now: one running
 * ({@link keepsForbidRunWaiting}; `locked` as a claim reads it), or one queued for its retry. The
 * polling fallback's `blocked` (store/overdue.ts) and a claim miss's `forbidBlocked`.
 */
export const forbidBlocked = (r: string, locked = false): string => `(
  ${r}.concurrency = 'forbid' AND EXISTS (
    SELECT 1 FROM runs o WHERE o.job_id = ${r}.job_id AND o.id <> ${r}.id
      AND ((o.state = 'running' AND ${keepsForbidRunWaiting('o', r, locked)})
           OR (o.state = 'queued' AND o.attempt > 0))))`;

/**
 * Whether queued run `r` (SQL) is a `forbid` job's retry or replay (attempt > 0: never skipped)
 * that another, running run of its job keeps from starting ({@link keepsForbidRunWaiting}; CLAIM
 * refuses it): it waits its turn, bounded by that run's claim deadline and the reaper. The polling
 * fallback leaves it alone meanwhile (store/overdue.ts), and the leader counts it apart from the
 * overdue runs (store/signals.ts): it is not stuck, and counted overdue, one such wait behind a
 * call of minutes fed HeliosRunsOverdueGrowing on a healthy cluster. The subquery runs only for
 * such runs (the cheap tests come first and AND stops at the first false).
 */
export const waitsForRunningSibling = (r: string): string => `(
  ${r}.concurrency = 'forbid' AND ${r}.attempt > 0 AND EXISTS (
    SELECT 1 FROM runs o WHERE o.job_id = ${r}.job_id AND o.state = 'running'
      AND ${keepsForbidRunWaiting('o', r)}))`;

/**
 * Moves queued, due runs to running for node $2 and records their attempts, in one statement.
 * $1 = run ids, $5 = the attempt each caller expects to start (parallel; NULL = any),
 * $2 = node id, $3 = claim grace ms, $4 = clock-skew tolerance ms, $6 = claim lead ms, $7 = the
 * misfire threshold ms: a run {@link misfiredAtClaim} is left (the claim misses; skipMisfiredRun).
 * An `allow` run may be claimed up to the lead before not_before (its call still starts at
 * not_before, so the attempt starts then and the claim deadline counts from then; a first attempt
 * claimed before not_before is started by {@link startRuns}, until which a pause or an edit may
 * withdraw it); `forbid` and
 * `replace` runs only once due, so their policy is judged against the runs active at that time.
 * A fresh occurrence of a `forbid` job is not claimed while a sibling waits to retry (that
 * sibling is still active), and no run of a `forbid` job while a sibling that copied another
 * policy runs and the job keeps its runs apart (it was edited to `forbid` during that call: before,
 * the next run was called beside it; edited back to `allow`, the run is called beside the job's
 * new runs: jobKeepsRunsApartLocked, read as committed, so never from before an edit that has
 * answered); a second *running* run of a `forbid` job violates
 * runs_forbid_one_running_idx and fails the whole statement.
 * The deadline and start count from this statement, not from its transaction's start (now()):
 * inside the polling fallback's transaction a claim may come seconds after it began, and a
 * deadline counted from then reached the worker with less than the timeout left (handed back).
 */
const CLAIM = `
  WITH input AS (
    SELECT * FROM unnest($1::uuid[], $5::int[]) AS c (id, expected)
  ), claimed AS (
    UPDATE runs r
    SET state = 'running', attempt = r.attempt + 1, claimed_by = $2, reason = NULL,
        claim_expires_at = greatest(statement_timestamp(), r.not_before)
                           + (r.timeout_ms + $3) * interval '1 millisecond',
        -- A run claimed before it is due has not started: started_at stays NULL until its call
        -- is about to begin (startRuns), and until then a pause or an edit withdraws it.
        started_at = CASE WHEN r.not_before > statement_timestamp() THEN r.started_at
                          ELSE coalesce(r.started_at, statement_timestamp()) END
    FROM input c
    -- "IS TRUE" (the same test) keeps the planner from proving runs_queued_idx's predicate and
    -- scanning every queued run when its statistics say there are few (a herd just created
    -- thousands): the plan stays one primary-key lookup per requested id.
    WHERE r.id = c.id AND (r.state = 'queued') IS TRUE
      AND r.not_before <= now() + ($4 + CASE WHEN r.concurrency = 'allow' THEN $6 ELSE 0 END)
                                  * interval '1 millisecond'
      AND (c.expected IS NULL OR r.attempt = c.expected - 1)
      AND NOT (r.concurrency = 'forbid' AND EXISTS (
        SELECT 1 FROM runs o
        WHERE o.job_id = r.job_id AND o.id <> r.id
          AND ((r.attempt = 0 AND o.state = 'queued' AND o.attempt > 0)
               -- A run still running from before an edit made the job \`forbid\`: the unique index
               -- (runs_forbid_one_running_idx) holds only runs that copied \`forbid\`. The job is
               -- looked up (and locked: jobKeepsRunsApartLocked) only for such a sibling.
               OR (o.state = 'running' AND o.concurrency <> 'forbid' AND ${jobKeepsRunsApartLocked('r')}))))
      AND NOT ${misfiredAtClaim('r', '$7', { below: '$8', leaderKey: '$9' })}
    RETURNING r.*
  ), recorded AS (
    INSERT INTO run_attempts (run_id, attempt, node_id, started_at)
    SELECT id, attempt, $2, greatest(statement_timestamp(), not_before) FROM claimed
  )
  SELECT ${CLAIMED_COLUMNS} FROM claimed`;

/**
 * `items` in the order of their run ids, the order every batch statement on `runs` (claims,
 * STARTs, completions, failures) takes its rows in: concurrent batches then lock rows in the same
 * order, which avoids most deadlocks between them.
 */
export function inLockOrder<T>(items: readonly T[], runId: (item: T) => string): T[] {
  return [...items].sort((a, b) => {
    const x = runId(a);
    const y = runId(b);
    return x < y ? -1 : x > y ? 1 : 0;
  });
}

/** Options every claim needs. */
export interface ClaimOptions {
  readonly nodeId: string;
  /** Added to the run's timeout to make the claim deadline. */
  readonly graceMs: number;
  /** A run may be claimed this long before its not_before, by the database clock. */
  readonly skewToleranceMs: number;
  /** An `allow` run may also be claimed this much earlier, its call waiting for not_before; default 0. */
  readonly leadMs?: number;
  /**
   * Misfire threshold (HELIOS_MISFIRE_THRESHOLD_MS): a run {@link misfiredAtClaim} is not claimed
   * but skipped. Default: none is.
   */
  readonly misfireThresholdMs?: number;
  /** Which leader epochs have ended, by etcd (EndedEpochs); null: unknown. */
  readonly endedEpochs?: () => EndedEpochsReading | null;
}

/**
 * One reading of etcd: every leader epoch whose token is below `below` has ended, in the leader key
 * `leaderKey` names (election.ts leaderKeyOf). It counts only where the fence names the same key:
 * a worker pointed at another etcd or prefix reads tokens unrelated to the fence's.
 */
export interface EndedEpochsReading {
  readonly below: bigint;
  readonly leaderKey: string;
}

/** A reading's two SQL parameters (both NULL for none). */
export function endedEpochsParams(
  reading: EndedEpochsReading | null | undefined,
): [string | null, string | null] {
  return reading ? [reading.below.toString(), reading.leaderKey] : [null, null];
}

/** Thrown by PostgreSQL when a claim would make a second run of a `forbid` job running. */
export function isForbidViolation(err: unknown): boolean {
  const e = err as { code?: unknown; constraint?: unknown } | null;
  return e?.code === '23505' && e.constraint === 'runs_forbid_one_running_idx';
}

/** One run to claim and the attempt the caller expects to start (null: whatever is next). */
export interface ClaimRequest {
  readonly runId: string;
  readonly expectedAttempt: number | null;
}

/**
 * Claims queued runs in one statement; returns, per request, the claimed run or null (another
 * worker won, it is not due, or a `forbid` sibling is active). Throws on a `forbid` violation
 * ({@link isForbidViolation}) or a deadlock with another batch: claim one by one then. Its rows
 * are locked in the plan's order; a pause holding one of them lets go rather than deadlock
 * (withdrawFutureRuns in jobs.ts).
 */
export async function claimRuns(
  db: Queryable,
  requests: readonly ClaimRequest[],
  options: ClaimOptions,
): Promise<(ClaimedRun | null)[]> {
  if (requests.length === 0) return [];
  const sorted = inLockOrder(requests, (r) => r.runId);
  // Named, so each connection parses and plans it once: planning this statement cost about as
  // much as running it for the dozen runs of a typical batch.
  const { rows } = await db.query<ClaimedRun>({ name: 'helios-claim-runs', text: CLAIM }, [
    sorted.map((r) => r.runId),
    options.nodeId,
    options.graceMs,
    options.skewToleranceMs,
    sorted.map((r) => r.expectedAttempt),
    options.leadMs ?? 0,
    options.misfireThresholdMs ?? null,
    ...endedEpochsParams(options.endedEpochs?.()),
  ]);
  const byId = new Map(rows.map((run) => [run.id, run]));
  return requests.map((r) => byId.get(r.runId) ?? null);
}

/** Claims one queued run; see {@link claimRuns}. */
export async function claimRun(
  db: Queryable,
  runId: string,
  options: ClaimOptions,
  expectedAttempt: number | null,
): Promise<ClaimedRun | null> {
  const [run] = await claimRuns(db, [{ runId, expectedAttempt }], options);
  return run ?? null;
}

/**
 * Marks runs claimed ahead of their time (ClaimedRun.startPending) started, where node $3 still
 * holds the attempt and the run is due by the database clock, give or take $4 ms (the workers'
 * clock skew tolerance; NULL: whenever): from here on a pause or an edit no longer withdraws them
 * (WITHDRAW_FUTURE_RUNS only takes runs whose started_at is NULL). Both statements write the row,
 * so whichever commits first wins and the other sees it: a withdrawn run is not started (nothing
 * to update), a started run is not withdrawn (the delete re-reads the row it waited for).
 * Parallel arrays: $1 = run ids, $2 = attempts. Returns the ids started. Repeatable: a retry after
 * a commit whose answer was lost finds the run started and says so. started_at is not indexed, so
 * this is a HOT update when the page has room (the completion later narrows it to when the call
 * began).
 */
const START = `
  WITH input AS MATERIALIZED (
    -- As in the completion statement: node and state as columns of a materialised input keep the
    -- plan one primary-key lookup per run, whatever the statistics say about running runs.
    SELECT s.*, $3::text AS node, 'running'::text AS running,
           coalesce(statement_timestamp() + $4::float8 * interval '1 millisecond', 'infinity') AS due_by
    FROM unnest($1::uuid[], $2::int[]) AS s (id, attempt)
  )
  -- Locks its runs in its plan's order, not necessarily by id: a pause holding one of them while it
  -- waits for another yields (withdrawFutureRuns in jobs.ts), so the two cannot deadlock.
  UPDATE runs r SET started_at = coalesce(r.started_at, statement_timestamp())
  FROM input s
  WHERE r.id = s.id AND r.attempt = s.attempt AND r.claimed_by = s.node AND r.state = s.running
    AND (r.not_before <= s.due_by OR r.started_at IS NOT NULL)
  RETURNING r.id, r.attempt`;

/**
 * Of runs START did not start, those node $3 still holds (its claim, running): START found them
 * not yet due, and how long until they are, by the database clock (≤ 0: due since); or another
 * START of the same run (a resend, a try whose answer timed out) has started them since.
 */
const NOT_YET_DUE = `
  WITH input AS MATERIALIZED (
    -- As in START: one primary-key lookup per run, whatever the statistics say.
    SELECT s.*, $3::text AS node, 'running'::text AS running
    FROM unnest($1::uuid[], $2::int[]) AS s (id, attempt)
  )
  SELECT r.id, r.attempt, extract(epoch FROM r.not_before - clock_timestamp())::float8 * 1000 AS due_in_ms,
         r.started_at IS NOT NULL AS started
  FROM input s JOIN runs r ON r.id = s.id
  WHERE r.attempt = s.attempt AND r.claimed_by = s.node AND r.state = s.running`;

/**
 * What START answered for one run: true, started (it may be called); false, withdrawn (a pause, an
 * edit, a deletion) or its claim lost; or not due yet by the database clock, for `dueInMs` more.
 */
export type StartAnswer = boolean | { readonly dueInMs: number };

/**
 * Starts claimed-ahead runs (see START) in one statement. `dueWithinMs`: how early by the database
 * clock a run may start (the clock skew tolerance); omitted, a run starts whenever asked. Runs it
 * did not start (withdrawn, or not yet due: rare) cost a second statement, which tells them apart.
 */
export async function startRuns(
  db: Queryable,
  nodeId: string,
  runs: readonly { readonly id: string; readonly attempt: number }[],
  dueWithinMs?: number,
  readTimeoutMs?: number,
): Promise<StartAnswer[]> {
  if (runs.length === 0) return [];
  const sorted = inLockOrder(runs, (r) => r.id);
  const { rows } = await db.query<{ id: string; attempt: number }>(
    withReadTimeout({ name: 'helios-start-runs', text: START }, readTimeoutMs),
    [sorted.map((r) => r.id), sorted.map((r) => r.attempt), nodeId, dueWithinMs ?? null],
  );
  // By attempt: a stale attempt of a run in the same batch as its current one is not started.
  const answers = new Map<string, StartAnswer>(rows.map((r) => [`${r.id}/${r.attempt}`, true]));
  const missed = dueWithinMs === undefined ? [] : runs.filter((r) => !answers.has(`${r.id}/${r.attempt}`));
  if (missed.length > 0) {
    const { rows: waiting } = await db.query<{
      id: string;
      attempt: number;
      due_in_ms: number;
      started: boolean;
    }>(withReadTimeout({ name: 'helios-start-not-yet-due', text: NOT_YET_DUE }, readTimeoutMs), [
      missed.map((r) => r.id),
      missed.map((r) => r.attempt),
      nodeId,
    ]);
    // Started since by another START of the same run (a resend, a try whose answer timed out):
    // started, not withdrawn.
    for (const r of waiting) answers.set(`${r.id}/${r.attempt}`, r.started ? true : { dueInMs: r.due_in_ms });
  }
  return runs.map((r) => answers.get(`${r.id}/${r.attempt}`) ?? false);
}

/** Why a claim returned nothing: the run as it is now. */
export interface ClaimMiss {
  readonly state: string;
  readonly attempt: number;
  /** Milliseconds until the run is due by the database clock (negative: overdue). */
  readonly dueInMs: number;
  /** A `forbid` run with another run of its job running or waiting to retry. */
  readonly forbidBlocked: boolean;
  /** A misfire its job's policy drops (misfiredAtClaim): skip it (skipMisfiredRun). */
  readonly misfired: boolean;
}

/**
 * The run's state for a claim that missed; null if the run no longer exists. $1 = run id, $2 =
 * the misfire threshold ms (NULL: none), $3 and $4 = etcd's reading of ended epochs (misfiredAtClaim).
 */
const EXPLAIN_MISS = `
  SELECT r.state, r.attempt,
         (extract(epoch FROM r.not_before - now()) * 1000)::float8 AS "dueInMs",
         ${forbidBlocked('r', true)} AS "forbidBlocked",
         (r.state = 'queued' AND ${misfiredAtClaim('r', '$2', { below: '$3', leaderKey: '$4' })}) AS misfired
  FROM runs r WHERE r.id = $1`;

export async function explainClaimMiss(
  db: Queryable,
  runId: string,
  misfireThresholdMs: number | null = null,
  ended: EndedEpochsReading | null = null,
): Promise<ClaimMiss | null> {
  const { rows } = await db.query<ClaimMiss>(EXPLAIN_MISS, [
    runId,
    misfireThresholdMs,
    ...endedEpochsParams(ended),
  ]);
  return rows[0] ?? null;
}

/**
 * Skips a queued run that cannot start (concurrency policy). $1 = run id, $2 = reason.
 * Only a fresh occurrence (never claimed) can be skipped: a retry or a dead-letter replay has
 * attempt > 0, and skipping it would lose a run that is owed; it waits for its turn instead.
 * finished_at is when the skip was decided (this statement), not when an enclosing transaction
 * began: the run that blocked it may have started in between.
 */
const SKIP = `
  UPDATE runs SET state = 'skipped', reason = $2, finished_at = statement_timestamp(), claimed_by = NULL
  WHERE id = $1 AND state = 'queued' AND attempt = 0`;

/** Returns true if this call skipped the run (false: already taken, or a retry that must wait). */
export async function skipRun(db: Queryable, runId: string, reason: string): Promise<boolean> {
  const { rowCount } = await db.query(SKIP, [runId, reason]);
  return rowCount === 1;
}

/**
 * Skips a queued run whose claim found it a misfire its job's policy drops (misfiredAtClaim, judged
 * again on the row this statement locks), with reason `misfire`. $1 = run ids, $2 = the threshold ms,
 * $3 and $4 = etcd's reading of ended epochs.
 */
const SKIP_MISFIRED = `
  UPDATE runs r SET state = 'skipped', reason = 'misfire', finished_at = statement_timestamp(), claimed_by = NULL
  WHERE r.id = ANY($1::uuid[]) AND r.state = 'queued' AND ${misfiredAtClaim('r', '$2', { below: '$3', leaderKey: '$4' })}`;

/** Returns true if this call skipped the run (false: taken meanwhile, or no longer a misfire). */
export async function skipMisfiredRun(
  db: Queryable,
  runId: string,
  misfireThresholdMs: number,
  ended: EndedEpochsReading | null = null,
): Promise<boolean> {
  return (await skipMisfiredRuns(db, [runId], misfireThresholdMs, ended)) === 1;
}

/** skipMisfiredRun for many runs in one statement; returns how many it skipped. */
export async function skipMisfiredRuns(
  db: Queryable,
  runIds: readonly string[],
  misfireThresholdMs: number,
  ended: EndedEpochsReading | null = null,
): Promise<number> {
  if (runIds.length === 0) return 0;
  const { rowCount } = await db.query(SKIP_MISFIRED, [
    runIds,
    misfireThresholdMs,
    ...endedEpochsParams(ended),
  ]);
  return rowCount ?? 0;
}

/**
 * When run `r` was asked for, which orders `replace` runs: a scheduled or manual run at its
 * occurrence (scheduled_for; a retry belongs to its occurrence), a replayed one when it was last
 * replayed. So a replay, which an operator asks for now, replaces the job's running newer
 * occurrence rather than being replaced by it with no call (its dead letter used up).
 */
const requestedAt = (r: string) =>
  `greatest(${r}.scheduled_for, (SELECT max(d.replayed_at) FROM dead_letters d WHERE d.run_id = ${r}.id))`;

/**
 * Whether run `s` (SQL) was asked for after run `n` (a row with its `asked`; ties by id) and has
 * been claimed since (started_at set: due, or STARTed; an attempt since its last replay).
 */
const startedLater = (s: string, n: string) => `
  ${s}.id <> ${n}.id AND ${s}.started_at IS NOT NULL
  AND (${requestedAt(s)}, ${s}.id) > (${n}.asked, ${n}.id)
  AND ${s}.attempt > (SELECT coalesce(max(d.attempt), 0) FROM dead_letters d
                      WHERE d.run_id = ${s}.id AND d.replayed_at IS NOT NULL)`;

/**
 * `replace`: fails every run of job $1 except the one asked for last (requestedAt) among those
 * running and started: the others running, and those queued that were asked for before it (an older run
 * waiting in its retry back-off, handed back, or whose announcement is late: once a run asked for
 * later has started, the older one is not called again, as a Kubernetes CronJob's `Replace` ends
 * the older Job with its pending retries; before, its retry was called after the newer run had
 * finished). Records the running ones' attempts as replaced, and NOTIFYs `helios_runs` so their
 * workers abort the HTTP call. Returns them, and the run left running (id, attempt, node) in a row
 * of its own (replaced = false). Run after a claim committed: whichever of two racing claims runs
 * this last sees both. A queued run another statement holds (a worker claiming it, a pause) is
 * left (SKIP LOCKED: it waits for no one's row), and so is a running one whose failed attempt's
 * settle held it (re-read once that commits, it is queued for its retry, and "waiting" was taken
 * before). Claimed, it runs this same statement, which fails it as replaced even when the newer
 * run no longer runs (its call ended, it waits to retry): the run asked for last among those
 * running is itself "overtaken" when a run asked for later has been claimed since it was asked
 * for (started_at set, an attempt since its last replay). Before, such an older run was called
 * after the newer one had ended (test/integration/replace-older-row-locked.test.ts). A run claimed
 * within the skew tolerance before its time counts only once STARTed: until then a pause or an edit
 * may withdraw it, and counted, it had replaced an older run due before the pause, so neither was
 * called. An older run's replacement leaves it running; its own, after its START, fails the older.
 */
const REPLACE_OLDER = `
  WITH newest AS (
    -- Started only: a run claimed within the skew tolerance before its time may yet be withdrawn by
    -- a pause or an edit; it replaces the others from its own START on (its replacement).
    SELECT r.id, r.attempt, r.claimed_by, ${requestedAt('r')} AS asked
    FROM runs r WHERE r.job_id = $1 AND r.state = 'running' AND r.started_at IS NOT NULL
    ORDER BY asked DESC, r.id DESC LIMIT 1
  ), replays AS MATERIALIZED (
    -- The job's runs replayed since, found by dead_letters_job_replayed_idx ("IS NOT NULL", implied,
    -- lets the planner use that partial index). Materialised: as an EXISTS, the planner scanned
    -- every dead letter, betting on an early match.
    SELECT d.run_id FROM newest n
    JOIN dead_letters d ON d.job_id = $1 AND d.replayed_at IS NOT NULL AND d.replayed_at >= n.asked
  ), overtaken AS (
    -- Later occurrences by runs_one_per_occurrence (a run is asked for no earlier than its
    -- scheduled_for), in an EXISTS that stops at the first: as a join over all of them, the
    -- planner's guess for "scheduled_for >= asked" (a third of the job's runs) put the statement's
    -- cost past jit_above_cost on a job with some 30,000 runs, and each call was JIT-compiled
    -- (≈60 ms, where it runs in ≈1 ms).
    SELECT n.id FROM newest n
    WHERE EXISTS (SELECT 1 FROM runs s
                  WHERE s.job_id = $1 AND s.scheduled_for >= n.asked AND ${startedLater('s', 'n')})
       OR EXISTS (SELECT 1 FROM replays l JOIN runs s ON s.id = l.run_id WHERE ${startedLater('s', 'n')})
  ), waiting AS (
    SELECT q.id FROM runs q, newest n
    WHERE q.job_id = $1 AND q.state = 'queued' AND (${requestedAt('q')}, q.id) < (n.asked, n.id)
    FOR UPDATE OF q SKIP LOCKED
  ), replaced AS (
    UPDATE runs r SET state = 'failed', reason = 'replaced', finished_at = now(),
                      claim_expires_at = NULL
    WHERE r.job_id = $1 AND (r.id <> (SELECT id FROM newest) OR r.id IN (SELECT id FROM overtaken))
      AND ((r.state = 'running' AND (r.started_at IS NOT NULL OR EXISTS (
             SELECT 1 FROM newest n WHERE (${requestedAt('r')}, r.id) < (n.asked, n.id))))
           OR (r.state = 'queued' AND r.id IN (SELECT id FROM waiting)))
    RETURNING r.id, r.attempt
  ), recorded AS (
    UPDATE run_attempts a SET outcome = 'replaced', finished_at = now(),
                              error = 'replaced by a run of the job asked for later'
    FROM replaced WHERE a.run_id = replaced.id AND a.attempt = replaced.attempt AND a.outcome IS NULL
  )
  -- pg_notify returns void: "IS NULL" (false) only gives its call a column the union can carry.
  SELECT id, NULL::int AS attempt, NULL::text AS node, true AS replaced,
         pg_notify('helios_runs', id::text) IS NULL AS notified
  FROM replaced
  UNION ALL
  SELECT id, attempt, claimed_by, false, false FROM newest WHERE id NOT IN (SELECT id FROM overtaken)`;

/** What a `replace` run's claim did to its job's running runs. */
export interface Replacement {
  /** The runs failed as replaced (possibly including the caller's own). */
  readonly replaced: string[];
  /**
   * The attempt left running, of the run asked for last; null when none runs, or when a run asked
   * for later has been claimed already (the one asked for last among those running is replaced too).
   */
  readonly running: { readonly id: string; readonly attempt: number; readonly nodeId: string } | null;
}

export async function replaceOlderRuns(db: Queryable, jobId: string): Promise<Replacement> {
  const { rows } = await db.query<{
    id: string;
    attempt: number | null;
    node: string | null;
    replaced: boolean;
  }>(REPLACE_OLDER, [jobId]);
  const newest = rows.find((r) => !r.replaced);
  return {
    replaced: rows.filter((r) => r.replaced).map((r) => r.id),
    running: newest ? { id: newest.id, attempt: newest.attempt!, nodeId: newest.node! } : null,
  };
}

/**
 * Of the claims this node believes it holds, the ones it no longer holds (replaced, expired and
 * taken over, or deleted). $1 = run ids, $2 = attempts (parallel), $3 = node id.
 *
 * One primary-key lookup per claim: OFFSET 0 keeps the planner from flattening the lookup into a
 * join, which for the few hundred claims a worker holds in a herd (its slots and start passes) it
 * ran as a hash join over a scan of the whole table: 10 ms a check with 20,000 runs, against
 * ≈1.5 ms for 576 lookups, once a second per worker while its calls are in flight.
 */
const LOST_CLAIMS = `
  SELECT c.id, r.state, r.reason
  FROM unnest($1::uuid[], $2::int[]) AS c (id, attempt)
  LEFT JOIN LATERAL (
    SELECT id, state, reason, claimed_by, attempt FROM runs WHERE id = c.id OFFSET 0
  ) r ON true
  WHERE r.id IS NULL OR r.state <> 'running' OR r.claimed_by IS DISTINCT FROM $3
     OR r.attempt <> c.attempt`;

export interface LostClaim {
  readonly id: string;
  readonly state: string | null;
  readonly reason: string | null;
}

export async function findLostClaims(
  db: Queryable,
  claims: readonly { runId: string; attempt: number }[],
  nodeId: string,
): Promise<LostClaim[]> {
  if (claims.length === 0) return [];
  // Named: parsed and planned once per connection (see claimRuns).
  const { rows } = await db.query<LostClaim>({ name: 'helios-lost-claims', text: LOST_CLAIMS }, [
    claims.map((c) => c.runId),
    claims.map((c) => c.attempt),
    nodeId,
  ]);
  return rows;
}

/** The message that announces the next attempt of a run. $1 topic, $2 key, $3 payload, $4 publish after. */
const ENQUEUE_ATTEMPT = `INSERT INTO outbox (topic, key, payload, publish_after) VALUES ($1, $2, $3, $4)`;

/**
 * A queued run as the statements that re-queue it return it (RETURNING REQUEUED_RUN_COLUMNS): what
 * the announcement of its next attempt is made of.
 */
export interface RequeuedRun {
  readonly id: string;
  readonly jobId: string;
  /** The attempt that ended; the next one is announced. */
  readonly attempt: number;
  readonly scheduledFor: Date;
  readonly notBefore: Date;
  readonly timeoutMs: number;
  readonly concurrency: ConcurrencyPolicy;
}

/** The columns of a {@link RequeuedRun}, for a RETURNING clause on `runs` (unqualified). */
export const REQUEUED_RUN_COLUMNS = `id, job_id AS "jobId", attempt, scheduled_for AS "scheduledFor",
  not_before AS "notBefore", timeout_ms AS "timeoutMs", concurrency`;

/** The announcement of a queued run's next attempt, as workers parse it. */
export function nextAttemptMessage(run: RequeuedRun): RunMessage {
  return {
    runId: run.id,
    jobId: run.jobId,
    attempt: run.attempt + 1,
    scheduledFor: run.scheduledFor,
    notBefore: run.notBefore,
    timeoutMs: run.timeoutMs,
    concurrency: run.concurrency,
  };
}

/**
 * Inserts the outbox row announcing the next attempt of a queued run, due at its not_before.
 * Returns the announcement, as workers parse it.
 */
export async function enqueueAttempt(
  db: Queryable,
  run: RequeuedRun,
  runsTopic: string,
): Promise<RunMessage> {
  const message = nextAttemptMessage(run);
  // Dates serialise as ISO-8601 UTC in the JSON payload.
  await db.query(ENQUEUE_ATTEMPT, [runsTopic, run.jobId, message, run.notBefore]);
  return message;
}
