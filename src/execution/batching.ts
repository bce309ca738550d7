import type pg from 'pg';
import { completeSucceededMany, type Success } from '../store/attempts.js';
import {
  claimRun,
  claimRuns,
  isDeadlock,
  isForbidViolation,
  type ClaimedRun,
  type ClaimOptions,
  type ClaimRequest,
} from '../store/runs.js';
import { MicroBatcher } from './micro-batcher.js';

/** A claim's result: the run, or why not (`forbidden`: another run of a forbid job is running). */
export type ClaimResult = ClaimedRun | 'missed' | 'forbidden';

/** Runs per claim or completion statement at most. */
const MAX_BATCH = 256;
/**
 * Statements of one kind (claims, completions) a worker runs at once; what arrives meanwhile
 * waits and goes in the next one, so batches grow with the load.
 */
const MAX_IN_FLIGHT = 2;

/**
 * Claims in batches (see MicroBatcher). When a batch fails as a whole, because two
 * runs of one `forbid` job were in it or another worker's batch deadlocked with it, its runs are
 * claimed one by one, so each gets its own answer.
 */
export function createClaimBatcher(
  pool: pg.Pool,
  options: ClaimOptions,
): MicroBatcher<ClaimRequest, ClaimResult> {
  return new MicroBatcher(
    async (requests) => {
      try {
        const runs = await claimRuns(pool, requests, options);
        return runs.map((run) => run ?? 'missed');
      } catch (err) {
        if (!isForbidViolation(err) && !isDeadlock(err)) throw err;
        const results: ClaimResult[] = [];
        for (const request of requests) {
          try {
            results.push((await claimRun(pool, request.runId, options, request.expectedAttempt)) ?? 'missed');
          } catch (one) {
            if (!isForbidViolation(one)) throw one;
            results.push('forbidden');
          }
        }
        return results;
      }
    },
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
}

/** Completes successful attempts in batches (see MicroBatcher). */
export function createCompletionBatcher(pool: pg.Pool, nodeId: string): MicroBatcher<Success, boolean> {
  return new MicroBatcher(
    async (items) => {
      try {
        return await completeSucceededMany(pool, nodeId, items);
      } catch (err) {
        if (!isDeadlock(err)) throw err;
        const results: boolean[] = [];
        for (const item of items) results.push(...(await completeSucceededMany(pool, nodeId, [item])));
        return results;
      }
    },
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
}
