import assert from 'node:assert/strict';
import type pg from 'pg';
import { patchJob } from '../../src/jobs/commands.js';
import type { ConcurrencyPolicy } from '../../src/model.js';
import { parseCron } from '../../src/scheduling/cron.js';
import { failAttempt } from '../../src/store/attempts.js';
import { inTransaction } from '../../src/store/db.js';
import type { JobRecord } from '../../src/store/jobs.js';
import { claimRuns, type ClaimedRun } from '../../src/store/runs.js';
import { http500Report, jobWithQueuedRuns, queuedRuns } from './execution.js';

export const TOPICS = { runsTopic: 'runs', deadLetterTopic: 'dead' };
export const COMMANDS = { runsTopic: 'runs', misfireThresholdMs: 5000 };
export const CLAIM_OPTIONS = { graceMs: 60_000, skewToleranceMs: 10 };

/**
 * What the tests of a `forbid` run against edits of its job's concurrency do to the runs of one
 * database (forbid-edited-retry.test.ts, forbid-edit-races.test.ts): every step through the store's
 * own functions and the command the API calls. `db`: the test's pool, once its database exists.
 */
export function forbidEdits(db: () => pg.Pool) {
  const claim = async (runId: string, nodeId = 'node-a'): Promise<ClaimedRun | null> => {
    const [run] = await claimRuns(db(), [{ runId, expectedAttempt: null }], { nodeId, ...CLAIM_OPTIONS });
    return run ?? null;
  };
  /** An occurrence of the job `ago` seconds ago, copied from the job as it is now, still queued. */
  const occurrence = async (job: string, ago: number): Promise<string> => {
    const [id] = await queuedRuns(db(), job, [`date_trunc('second', now()) - interval '${ago} seconds'`]);
    return id!;
  };
  return {
    claim,
    occurrence,
    /** An every-second job (its next run an hour away: the test makes its runs) and one run due 3 s ago. */
    async jobWithRun(concurrency: ConcurrencyPolicy): Promise<{ job: string; run: string }> {
      const { job, runs } = await jobWithQueuedRuns(db(), {
        name: 'fe',
        schedule: '* * * * * *',
        concurrency,
        dueAt: ["date_trunc('second', now()) - interval '3 seconds'"],
      });
      return { job, run: runs[0]! };
    },
    /** An occurrence of the job `ago` seconds ago claimed by `nodeId`: its call in flight. */
    async runningRun(job: string, ago = 1, nodeId = 'node-b'): Promise<string> {
      const id = await occurrence(job, ago);
      assert.ok(await claim(id, nodeId), `run ${id} claimed`);
      return id;
    },
    /** Claims the run and fails its call: queued for its retry, due at once (or dead). */
    async failOnce(runId: string, retryable = true) {
      const run = await claim(runId);
      assert.ok(run, `run ${runId} claimed`);
      return inTransaction(db(), (c) =>
        failAttempt(c, run, { nodeId: 'node-a' }, http500Report(retryable), 0, TOPICS),
      );
    },
    /** PATCH of the job's concurrency, through the command the API calls. */
    async patchConcurrency(job: string, concurrency: ConcurrencyPolicy): Promise<void> {
      const edited = await patchJob(
        db(),
        { id: job },
        (current: JobRecord) => ({
          fields: { ...current, concurrency },
          schedule: parseCron(current.schedule, current.timezone),
        }),
        COMMANDS,
      );
      assert.equal(edited?.concurrency, concurrency);
    },
    async stateOf(runId: string) {
      const { rows } = await db().query<{ state: string; attempt: number; concurrency: string }>(
        'SELECT state, attempt, concurrency FROM runs WHERE id = $1',
        [runId],
      );
      return rows[0]!;
    },
    /** Ends a running run as succeeded, as its worker's completion would. */
    succeed: (runId: string) =>
      db().query(
        `UPDATE runs SET state = 'succeeded', finished_at = now(), claim_expires_at = NULL WHERE id = $1`,
        [runId],
      ),
  };
}
