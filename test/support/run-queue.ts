import { DbClock } from '../../src/execution/db-clock.js';
import { RunQueue, type RunQueueOptions } from '../../src/execution/run-queue.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { fakeClaimedRun } from './claimed-run.js';
import { waitFor } from './execution.js';

/**
 * A RunQueue for unit tests, with fakes: every claim succeeds (fakeClaimedRun), no claim lead, no
 * claims ahead of the free slots (claimGraceMs 0), 2 slots, nothing logged. `run` plays
 * attempt.ts; the rest can be overridden.
 */
export function testRunQueue(overrides: Partial<RunQueueOptions> & Pick<RunQueueOptions, 'run'>): RunQueue {
  return new RunQueue({
    claim: async (request) => ({ kind: 'claimed', run: fakeClaimedRun(request.runId, request.attempt) }),
    claimLeadMs: 0,
    claimGraceMs: 0,
    concurrency: 2,
    prefetch: 1000,
    clock: new DbClock(),
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics: createMetrics('test'),
    ...overrides,
  });
}

/** Sets a queue's call time estimate (run-queue.ts), as a node that has timed `timed` calls has it. */
export function setCallTime(queue: RunQueue, callMs: number, timed = 20): void {
  Object.assign(queue as unknown as { callMs: number; callsTimed: number }, { callMs, callsTimed: timed });
}

/** A DbClock whose estimate can be moved, as a re-sync moves it. */
export class MovableClock extends DbClock {
  shiftMs = 0;
  override now(): number {
    return super.now() + this.shiftMs;
  }
}

/**
 * Waits until `done()` holds, polling every 2 ms (the queue's steps take a few ms); fails naming
 * `what` after `timeoutMs`.
 */
export async function until(done: () => boolean, what: string, timeoutMs = 3_000): Promise<void> {
  await waitFor(what, done, timeoutMs, 2);
}
