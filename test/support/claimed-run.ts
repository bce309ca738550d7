import type { ClaimedRun } from '../../src/store/runs.js';

/**
 * A run as a claim returns it, for unit tests of the worker's timing and slots, which never reach
 * PostgreSQL: due now, claim valid for 10 s, a target nobody listens on.
 */
export function fakeClaimedRun(runId: string, attempt = 1): ClaimedRun {
  return {
    id: runId,
    jobId: runId,
    attempt,
    maxAttempts: 3,
    failuresBefore: attempt - 1,
    scheduledFor: new Date(),
    target: { url: 'http://127.0.0.1:9/' },
    timeoutMs: 1000,
    backoffMs: 0,
    backoffMultiplier: 2,
    concurrency: 'allow',
    notBefore: new Date(),
    claimExpiresAt: new Date(Date.now() + 10_000),
    startPending: false,
  };
}
