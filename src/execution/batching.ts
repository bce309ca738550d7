import type { Connections } from '../store/pool-share.js';
import { toError } from '../errors.js';
import { inTransaction, isDatabaseUnavailable } from '../store/db.js';
import {
  completeSucceededMany,
  failAttempt,
  failMany,
  lockFreeJobs,
  releaseClaim,
  type AttemptReport,
  type Failure,
  type FailureResult,
  type Success,
  type Topics,
} from '../store/attempts.js';
import {
  claimRun,
  claimRuns,
  isForbidViolation,
  startRuns,
  type StartAnswer,
  type ClaimedRun,
  type ClaimOptions,
  type ClaimRequest,
} from '../store/runs.js';
import { releaseClaims, type Release } from '../store/releases.js';
import type { RunMessage } from '../model.js';
import { BatchItemError, MicroBatcher } from './micro-batcher.js';
import type { DbClock } from './db-clock.js';

/** A claim's result: the run, or why not (`forbidden`: another run of a forbid job is running). */
export type ClaimResult = ClaimedRun | 'missed' | 'forbidden';

/** Runs per claim or completion statement at most. */
export const MAX_BATCH = 256;
/**
 * Statements of one kind (claims, completions) a worker runs at once; what arrives meanwhile
 * waits and goes in the next one, so batches grow with the load.
 */
export const MAX_IN_FLIGHT = 2;
/** Items that fail one by one for want of the database, none succeeding, before the rest are failed without a try. */
const OUTAGE_AFTER = 2;

/**
 * Runs a failed batch's items one statement each, so each gets its own answer: one item the
 * database refuses (a constraint, a trigger, a value it cannot store) no longer fails the others.
 * When the first items all fail because the database is away (no connection, the pool is
 * exhausted: `isOutage`), the rest fail with the same error at once rather than each waiting for
 * its own connection timeout.
 */
export async function oneByOne<I, O>(
  items: readonly I[],
  single: (item: I) => Promise<O>,
  isOutage: (err: unknown) => boolean = isDatabaseUnavailable,
): Promise<(O | BatchItemError)[]> {
  const results: (O | BatchItemError)[] = [];
  let succeeded = 0;
  let outage: BatchItemError | undefined;
  let outages = 0;
  for (const item of items) {
    // Only failures that say the database is away count: items the database refused on their
    // own (however many lead the batch) must not fail the healthy ones behind them.
    if (outage && succeeded === 0 && outages >= OUTAGE_AFTER) {
      results.push(outage);
      continue;
    }
    try {
      results.push(await single(item));
      succeeded += 1;
    } catch (err) {
      const failure = new BatchItemError(toError(err));
      if (isOutage(err)) {
        outage = failure;
        outages += 1;
      }
      results.push(failure);
    }
  }
  return results;
}

/**
 * Claims in batches (see MicroBatcher). When a batch fails as a whole (two runs of one `forbid`
 * job were in it, another worker's batch deadlocked with it, or any other error), its runs are
 * claimed one by one, so each gets its own answer.
 */
export function createClaimBatcher(
  pool: Connections,
  options: ClaimOptions,
): MicroBatcher<ClaimRequest, ClaimResult> {
  return new MicroBatcher(
    async (requests) => {
      try {
        const runs = await claimRuns(pool, requests, options);
        return runs.map((run) => run ?? 'missed');
      } catch {
        return oneByOne(requests, async (request): Promise<ClaimResult> => {
          try {
            return (await claimRun(pool, request.runId, options, request.expectedAttempt)) ?? 'missed';
          } catch (one) {
            if (!isForbidViolation(one)) throw one;
            return 'forbidden';
          }
        });
      }
    },
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
}

/** Completions held back at most per worker; past this they go. */
const COMPLETIONS_WAITING_MAX = 2048;
/**
 * The claim a success must have left, beyond its hold, to wait: when its hold ends it still has
 * ≥ 4 s, for its turn behind the other held writes (2,048 are 4 rounds of two 256-run statements,
 * ≈10 ms each at the ≈35 µs a completed run costs PostgreSQL: written in time down to 512 rows a
 * second) and for retries of a failed write while the claim holds (attempt.ts).
 */
export const CLAIM_LEFT_AFTER_HOLD_MS = 4000;
/** A response excerpt longer than this is written at once (bounds what held completions keep). */
const WAITING_EXCERPT_MAX = 1024;

/**
 * Whether a success's write may wait up to `holdMs` (HELIOS_COMPLETION_HOLD_MS; 0: never) while
 * this worker's calls are underway (the completion batcher's WaitPolicy): it changes nothing
 * another run waits for, and it is written well within its claim. Not for `forbid` or `replace`
 * runs (the job's next run waits for this one to end), nor for a claim with less than the hold +
 * CLAIM_LEFT_AFTER_HOLD_MS left, nor for a large response excerpt.
 */
export function completionMayWait(
  run: ClaimedRun,
  report: AttemptReport,
  clock: DbClock,
  holdMs: number,
): boolean {
  return (
    holdMs > 0 &&
    run.concurrency === 'allow' &&
    (report.responseExcerpt?.length ?? 0) <= WAITING_EXCERPT_MAX &&
    clock.msLeftUntil(run.claimExpiresAt) >= holdMs + CLAIM_LEFT_AFTER_HOLD_MS
  );
}

/**
 * Completes successful attempts in batches (see MicroBatcher). A batch that fails is retried item
 * by item, so a completion the database refuses costs no other run its completion (each item's
 * caller retries its own failure while its claim holds: see execution/attempt.ts). Completions
 * added as `mayWait` are held while `callsUnderway()`: from the due instant of a herd until its
 * last call has ended, the CPU goes to the calls and their STARTs (a completion costs the node
 * and PostgreSQL ≈0.05 ms), and the held completions then go in full batches. (Held only until
 * the last run had a slot, the burst of writes then delayed the last calls' STARTs: the call
 * time the queue sampled there grew to 190 ms and the next herd was claimed ahead less than
 * half.) A call that got its slot with nothing waiting (a long call beside a light load) holds
 * nothing back. Under steady load beyond the slots calls are always underway: the writes then go
 * in rounds, those held until the oldest has waited `holdMs` (or COMPLETIONS_WAITING_MAX are
 * held), and every other while that statement runs (MicroBatcher holds nothing while a batch runs).
 */
export function createCompletionBatcher(
  pool: Connections,
  nodeId: string,
  hold?: { holdMs: number; callsUnderway: () => boolean; writesHeldGrew: () => void },
): MicroBatcher<Success, boolean> {
  return new MicroBatcher(
    async (items) => {
      try {
        return await completeSucceededMany(pool, nodeId, items);
      } catch {
        return oneByOne(items, async (item) => (await completeSucceededMany(pool, nodeId, [item]))[0]!);
      }
    },
    MAX_BATCH,
    MAX_IN_FLIGHT,
    hold && {
      busy: () => hold.callsUnderway(),
      maxWaitMs: hold.holdMs,
      maxWaiting: COMPLETIONS_WAITING_MAX,
      onHold: () => hold.writesHeldGrew(),
    },
  );
}

/** Whether this failure buries its run (no attempt left, or a call that can never be made). */
const buries = (failure: Failure) =>
  failure.report.retryable === false || failure.run.attempt >= failure.run.maxAttempts;

/** Settles one failure in its own transaction, as before batches (failAttempt). */
const failAlone = (pool: Connections, nodeId: string, item: Failure, topics: Topics) =>
  inTransaction(pool, (client) =>
    failAttempt(client, item.run, { nodeId }, item.report, item.retryDelayMs, topics),
  );

/**
 * Settles a batch of failures: the retries in one statement, which locks nothing but their runs;
 * the runs they bury in one transaction that first takes the key-share locks their dead letters
 * need on their jobs, skipping a job another command holds (a pause, an edit, a delete: each holds
 * its job's row while it waits for the job's runs, so a batch that waited for that row while
 * holding its other runs closed a deadlock cycle through another worker's claim, and stalled the
 * failures of every other job in it); and what is left (such a run, a retry the database would
 * bury after all, a stale attempt) one transaction each, as before batches. Never rejects: an
 * item that fails alone too gets its own BatchItemError.
 */
async function settleFailures(
  pool: Connections,
  nodeId: string,
  items: readonly Failure[],
  topics: Topics,
): Promise<(FailureResult | null | BatchItemError)[]> {
  const results: (FailureResult | null | BatchItemError | undefined)[] = items.map(() => undefined);
  const retries = items.flatMap((item, at) => (buries(item) ? [] : [at]));
  const burials = items.flatMap((item, at) => (buries(item) ? [at] : []));
  // A part that fails leaves its items to be settled alone below: each part is all or nothing,
  // and a part already written must not be tried again (its runs would read as claims lost).
  if (retries.length > 0) {
    const written = await failMany(
      pool,
      nodeId,
      retries.map((at) => items[at]!),
      topics,
      { retriesOnly: true },
    ).catch(() => []);
    retries.forEach((at, k) => {
      if (written[k]) results[at] = written[k];
    });
  }
  if (burials.length > 0) {
    // The results count once the transaction has committed.
    const committed = await inTransaction(pool, async (client) => {
      const locked = await lockFreeJobs(client, [...new Set(burials.map((at) => items[at]!.run.jobId))]);
      const mine = burials.filter((at) => locked.has(items[at]!.run.jobId));
      const written = await failMany(
        client,
        nodeId,
        mine.map((at) => items[at]!),
        topics,
      );
      return mine.map((at, k) => [at, written[k] ?? null] as const);
    }).catch(() => []);
    for (const [at, result] of committed) results[at] = result;
  }
  const left = results.flatMap((result, at) => (result === undefined ? [at] : []));
  const alone = await oneByOne(
    left.map((at) => items[at]!),
    (item) => failAlone(pool, nodeId, item, topics),
  );
  left.forEach((at, k) => (results[at] = alone[k]!));
  return results as (FailureResult | null | BatchItemError)[];
}

/**
 * Settles failed attempts in batches (see MicroBatcher and settleFailures): retries and dead
 * letters, each with its announcement. One transaction of five statements per failure was what a
 * herd whose target was down spent its time on (10,000 failures took 12 s to write, longer than
 * their claims last). Never held back: a retry is due after its back-off, and a `forbid` job's
 * next run waits for it. A part of a batch that fails is retried item by item, each in its own
 * transaction (settleFailures never rejects: each part answers for itself).
 */
export function createFailureBatcher(
  pool: Connections,
  nodeId: string,
  topics: Topics,
): MicroBatcher<Failure, FailureResult | null> {
  return new MicroBatcher((items) => settleFailures(pool, nodeId, items, topics), MAX_BATCH, MAX_IN_FLIGHT);
}

/** A run claimed ahead of its time whose call is about to begin. */
export interface StartRequest {
  readonly id: string;
  readonly attempt: number;
}

/**
 * Starts claimed-ahead runs in batches (see MicroBatcher; a herd's runs all start at their
 * instant): see StartAnswer. A run is started only when due by the database clock within
 * `dueWithinMs` (the clock skew tolerance). A batch that fails is retried item by item, as
 * completions are.
 */
export function createStartBatcher(
  pool: Connections,
  nodeId: string,
  dueWithinMs: number,
): MicroBatcher<StartRequest, StartAnswer> {
  return new MicroBatcher(
    async (runs) => {
      try {
        return await startRuns(pool, nodeId, runs, dueWithinMs);
      } catch {
        return oneByOne(runs, async (run) => (await startRuns(pool, nodeId, [run], dueWithinMs))[0]!);
      }
    },
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
}

/**
 * Gives claims back in batches (see MicroBatcher): a stopping worker's runs claimed ahead that it
 * will not call, and calls its drain aborted. One transaction of four statements per run was
 * what a worker stopped just before a herd spent its drain on (1,200 of 3,300 runs handed back in
 * 4.7 s; the rest stayed claimed until their claims expired, 35 s late). A batch that fails is
 * retried item by item, each in its own transaction (releaseClaim).
 */
export function createReleaseBatcher(
  pool: Connections,
  nodeId: string,
  runsTopic: string,
): MicroBatcher<Release, RunMessage | null> {
  return new MicroBatcher(
    async (items) => {
      try {
        return await releaseClaims(pool, nodeId, items, runsTopic);
      } catch {
        return oneByOne(items, (item) =>
          inTransaction(pool, (client) =>
            releaseClaim(client, item.run, nodeId, item.report, runsTopic, item.expiryBound),
          ),
        );
      }
    },
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
}
