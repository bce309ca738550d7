import type { Connections } from '../store/pool-share.js';
import { toError } from '../errors.js';
import { inTransaction, isDatabaseUnavailable, QUERY_READ_TIMEOUT_MS } from '../store/db.js';
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
 * A settle write's item (a completion, a failure, a hand-back): its run's claim deadline, which a
 * worker's item carries (a ClaimedRun), bounds how long the write waits for its answer
 * (settleReadTimeoutMs). Without it, the pool's read timeout.
 */
export interface ClaimBound {
  readonly run: { readonly claimExpiresAt?: Date };
}

/** The least a settle statement waits for its answer (see settleReadTimeoutMs). */
const SETTLE_READ_TIMEOUT_MIN_MS = 250;

/**
 * How long a batch of settle writes waits for each statement's answer: half of what is left of the
 * earliest of its claims (`claimExpiresAt`, by the later estimate of the database clock), at least
 * SETTLE_READ_TIMEOUT_MIN_MS, at most the pool's read timeout; undefined (the pool's) without a
 * clock or a deadline. A settle write sent on a connection gone silent (a NAT or firewall that lost
 * its state) waited the pool's 35 s, past the claim: the reaper re-queued the run, and a run whose
 * call had succeeded was called again; meanwhile the batcher's two batches in flight held every
 * settle write of the worker behind them. Past the bound the statement fails, the connection is
 * discarded, and the write is tried again on another (the batch item by item, then attempt.ts
 * whileClaimed) with the other half of the claim left for it. Every settle write is conditional on
 * the claim, so one whose answer was not waited for but that committed leaves the retry nothing to
 * write (it reports the claim settled, which attempt.ts staleOrRecorded tells from a claim lost).
 * A transaction's COMMIT is bounded too (inTransaction's boundCommit): one that PostgreSQL never
 * got waited 35 s; the server ends such a transaction 5 s on (idle_in_transaction_session_timeout),
 * its locks with it, and the retry then writes. The earliest claim, not the
 * latest: a batch of a run whose claim ends in 3 s and one whose claim ends in a minute waited 30 s,
 * and the first run's claim expired meanwhile. A batch given up on early costs its runs one statement
 * each on another connection; a settle statement takes milliseconds, and the bound is ≥ 250 ms.
 */
export function settleReadTimeoutMs(
  items: readonly ClaimBound[],
  clock: Pick<DbClock, 'latestNow'> | undefined,
): number | undefined {
  if (!clock) return undefined;
  const expiresAt = Math.min(...items.map((item) => item.run.claimExpiresAt?.getTime() ?? Infinity));
  if (!Number.isFinite(expiresAt)) return undefined;
  const halfLeftMs = Math.ceil((expiresAt - clock.latestNow()) / 2);
  return Math.min(QUERY_READ_TIMEOUT_MS, Math.max(SETTLE_READ_TIMEOUT_MIN_MS, halfLeftMs));
}

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
  clock?: Pick<DbClock, 'latestNow'>,
): MicroBatcher<Success & ClaimBound, boolean> {
  const complete = async (items: readonly (Success & ClaimBound)[]) =>
    completeSucceededMany(pool, nodeId, items, settleReadTimeoutMs(items, clock));
  return new MicroBatcher(
    async (items) => {
      try {
        return await complete(items);
      } catch {
        return oneByOne(items, async (item) => (await complete([item]))[0]!);
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

/**
 * Settles one failure in its own transaction, as before batches (failAttempt); its statements and
 * COMMIT wait `readTimeoutMs` at most for their answers (settleReadTimeoutMs).
 */
const failAlone = (
  pool: Connections,
  nodeId: string,
  item: Failure,
  topics: Topics,
  readTimeoutMs: number | undefined,
) =>
  inTransaction(
    pool,
    (client) => failAttempt(client, item.run, { nodeId }, item.report, item.retryDelayMs, topics),
    { readTimeoutMs, boundCommit: true },
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
  items: readonly (Failure & ClaimBound)[],
  topics: Topics,
  clock: Pick<DbClock, 'latestNow'> | undefined,
): Promise<(FailureResult | null | BatchItemError)[]> {
  const results: (FailureResult | null | BatchItemError | undefined)[] = items.map(() => undefined);
  const retries = items.flatMap((item, at) => (buries(item) ? [] : [at]));
  const burials = items.flatMap((item, at) => (buries(item) ? [at] : []));
  // A part that fails leaves its items to be settled alone below: each part is all or nothing,
  // and a part already written must not be tried again (its runs would read as claims lost).
  if (retries.length > 0) {
    const part = retries.map((at) => items[at]!);
    const readTimeoutMs = settleReadTimeoutMs(part, clock);
    const written = await failMany(pool, nodeId, part, topics, { retriesOnly: true, readTimeoutMs }).catch(
      () => [],
    );
    retries.forEach((at, k) => {
      if (written[k]) results[at] = written[k];
    });
  }
  if (burials.length > 0) {
    // The results count once the transaction has committed (its COMMIT bounded as its statements).
    const readTimeoutMs = settleReadTimeoutMs(
      burials.map((at) => items[at]!),
      clock,
    );
    const committed = await inTransaction(
      pool,
      async (client) => {
        const locked = await lockFreeJobs(client, [...new Set(burials.map((at) => items[at]!.run.jobId))]);
        const mine = burials.filter((at) => locked.has(items[at]!.run.jobId));
        const written = await failMany(
          client,
          nodeId,
          mine.map((at) => items[at]!),
          topics,
        );
        return mine.map((at, k) => [at, written[k] ?? null] as const);
      },
      { readTimeoutMs, boundCommit: true },
    ).catch(() => []);
    for (const [at, result] of committed) results[at] = result;
  }
  const left = results.flatMap((result, at) => (result === undefined ? [at] : []));
  const alone = await oneByOne(
    left.map((at) => items[at]!),
    (item) => failAlone(pool, nodeId, item, topics, settleReadTimeoutMs([item], clock)),
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
  clock?: Pick<DbClock, 'latestNow'>,
): MicroBatcher<Failure & ClaimBound, FailureResult | null> {
  return new MicroBatcher(
    (items) => settleFailures(pool, nodeId, items, topics, clock),
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
}

/** A run claimed ahead of its time whose call is about to begin. */
export interface StartRequest {
  readonly id: string;
  readonly attempt: number;
  /**
   * Database time (ms) after which a call begun could no longer end within the claim (its
   * deadline less the run's timeout): a START answered later is worth nothing (see
   * startReadTimeoutMs). Omitted: the pool's read timeout.
   */
  readonly answerBy?: number;
}

/** The least a START statement waits for its answer (see startReadTimeoutMs). */
const START_READ_TIMEOUT_MIN_MS = 250;

/**
 * How long a batch of STARTs waits for its answer: until the last of its runs could no longer be
 * called within its claim (`answerBy`, by the later estimate of the database clock), at least
 * START_READ_TIMEOUT_MIN_MS, at most the pool's read timeout. A START sent on a connection gone
 * silent (a NAT or firewall that lost its state) waited the pool's 35 s; two such batches (the
 * batcher's MAX_IN_FLIGHT) held every START of the worker behind them, and its runs claimed
 * ahead waited out claim after claim uncalled, each a forgiven expiry, until their attempts were
 * charged and they died. Past the bound the statement fails and the connection is discarded.
 */
export function startReadTimeoutMs(
  runs: readonly StartRequest[],
  clock: Pick<DbClock, 'latestNow'>,
): number | undefined {
  const answerBy = Math.max(...runs.map((run) => run.answerBy ?? Infinity));
  if (!Number.isFinite(answerBy)) return undefined;
  const leftMs = Math.ceil(answerBy - clock.latestNow());
  return Math.min(QUERY_READ_TIMEOUT_MS, Math.max(START_READ_TIMEOUT_MIN_MS, leftMs));
}

/**
 * A START still unanswered halfway to its bound (startReadTimeoutMs: when its runs could no
 * longer be called within their claims) is sent again on another connection (START is
 * repeatable), and the first answer counts. Given up only
 * at its bound (startReadTimeoutMs), a START on a silent connection was tried again once no call
 * could end within the claim any more: the retry started the run, and the worker handed it back
 * as claimed too late. The first statement is not given up at the half: one the database is
 * slow to answer (a lock, a loaded server) still counts when it answers in time, as before, and
 * the second then waits behind its row locks and changes nothing.
 */
export function hedged<T>(send: () => Promise<T>, resendAfterMs: number | undefined): Promise<T> {
  if (resendAfterMs === undefined) return send();
  return new Promise<T>((resolve, reject) => {
    let inFlight = 0;
    let firstErr: unknown;
    const go = () => {
      inFlight += 1;
      send().then(
        (value) => {
          clearTimeout(timer);
          resolve(value);
        },
        (err: unknown) => {
          inFlight -= 1;
          firstErr ??= err;
          // A first statement refused before the half is not sent again here (the caller's
          // fallback takes over, as before); after it, the other may still answer.
          if (inFlight === 0) {
            clearTimeout(timer);
            reject(toError(firstErr));
          }
        },
      );
    };
    const timer = setTimeout(go, resendAfterMs);
    go();
  });
}

/**
 * Starts claimed-ahead runs in batches (see MicroBatcher; a herd's runs all start at their
 * instant): see StartAnswer. A run is started only when due by the database clock within
 * `dueWithinMs` (the clock skew tolerance). A batch unanswered halfway to its read timeout is
 * sent again on another connection (hedged). A batch that fails is retried
 * item by item, as completions are.
 */
export function createStartBatcher(
  pool: Connections,
  nodeId: string,
  dueWithinMs: number,
  clock?: Pick<DbClock, 'latestNow'>,
): MicroBatcher<StartRequest, StartAnswer> {
  const readTimeout = (runs: readonly StartRequest[]) =>
    clock ? startReadTimeoutMs(runs, clock) : undefined;
  const start = (runs: readonly StartRequest[]) => {
    const readTimeoutMs = readTimeout(runs);
    return hedged(
      () => startRuns(pool, nodeId, runs, dueWithinMs, readTimeout(runs)),
      readTimeoutMs === undefined ? undefined : readTimeoutMs / 2,
    );
  };
  return new MicroBatcher(
    async (runs) => {
      try {
        return await start(runs);
      } catch {
        return oneByOne(runs, async (run) => (await start([run]))[0]!);
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
  clock?: Pick<DbClock, 'latestNow'>,
): MicroBatcher<Release & ClaimBound, RunMessage | null> {
  return new MicroBatcher(
    async (items) => {
      try {
        return await releaseClaims(pool, nodeId, items, runsTopic, settleReadTimeoutMs(items, clock));
      } catch {
        return oneByOne(items, (item) =>
          inTransaction(
            pool,
            (client) => releaseClaim(client, item.run, nodeId, item.report, runsTopic, item.expiryBound),
            { readTimeoutMs: settleReadTimeoutMs([item], clock), boundCommit: true },
          ),
        );
      }
    },
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
}
