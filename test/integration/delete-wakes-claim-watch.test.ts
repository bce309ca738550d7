import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { ClaimLostError } from '../../src/errors.js';
import { watchClaims } from '../../src/execution/claim-watch.js';
import { deleteJob } from '../../src/jobs/commands.js';
import { silentLogger } from '../../src/observability/logger.js';
import { Notifications } from '../../src/store/notifications.js';
import { claimRuns } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { jobWithQueuedRuns, waitFor } from '../support/execution.js';

// A job's delete NOTIFYs `helios_runs` when it had a running run (store/jobs.ts DELETE), so the
// workers' claim watches check at once: a run already marked started that waits for its slot
// (run-queue.ts, start passes) or a call in flight is stopped within a round trip of the delete,
// not at the watch's next interval (HELIOS_CLAIM_CHECK_INTERVAL_MS, 1 s). Real PostgreSQL; the
// watch's interval here is a minute, so only the notification can wake it within the test.

let db: TestDatabase;
const NODE = 'node-a';

before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** A job with one due run claimed (running) by NODE. */
async function jobWithRunningRun(): Promise<{ jobId: string; runId: string; attempt: number }> {
  const { job, runs } = await jobWithQueuedRuns(db.pool, {
    name: 'del',
    schedule: '0 0 1 1 *',
    concurrency: 'allow',
    dueAt: ['now()'],
  });
  const [claimed] = await claimRuns(db.pool, [{ runId: runs[0]!, expectedAttempt: null }], {
    nodeId: NODE,
    graceMs: 5000,
    skewToleranceMs: 10,
  });
  assert.ok(claimed);
  return { jobId: job, runId: claimed.id, attempt: claimed.attempt };
}

test("a job's delete wakes the claim watch at once: its running run's execution is aborted, its outcome unwanted", async () => {
  const { jobId, runId, attempt } = await jobWithRunningRun();
  const notifications = new Notifications(db.url, ['helios_runs'], silentLogger, { retryDelayMs: 50 });
  notifications.start();
  const stop = new AbortController();
  const controller = new AbortController();
  const watch = watchClaims({
    pool: db.pool,
    nodeId: NODE,
    notifications,
    claims: () => [{ runId, attempt, controller }],
    intervalMs: 60_000,
    logger: silentLogger,
    signal: stop.signal,
  });
  try {
    // The LISTEN session is up once a notification of our own arrives.
    await waitFor(
      'the LISTEN session',
      async () => {
        const woken = notifications.wait('helios_runs', 200, stop.signal);
        await db.pool.query(`SELECT pg_notify('helios_runs', 'probe')`);
        await woken;
        return true;
      },
      5_000,
      20,
    );
    // The probe's wake-up made the watch check once; give that check its round trip.
    await new Promise((resolve) => setTimeout(resolve, 100));
    assert.equal(controller.signal.aborted, false, 'the claim is held: nothing to abort');
    const deletedAt = performance.now();
    assert.equal(await deleteJob(db.pool, { id: jobId }), true);
    await waitFor('the execution aborted', () => controller.signal.aborted, 3_000, 5);
    const tookMs = performance.now() - deletedAt;
    assert.ok(tookMs < 1_000, `aborted ${Math.round(tookMs)} ms after the delete`);
    const reason = controller.signal.reason as ClaimLostError;
    assert.ok(reason instanceof ClaimLostError);
    assert.equal(reason.outcomeWanted, false, 'a deleted run is called by no one again');
  } finally {
    stop.abort();
    await watch;
    await notifications.stop();
  }
});
