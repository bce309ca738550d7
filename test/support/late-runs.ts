import { setTimeout as sleep } from 'node:timers/promises';
import { nextWholeSecond, waitFor } from './execution.js';
import type { IntegrationFixture } from './fixture.js';

/** A `skip` job firing every second from the next whole second; returns its id and first due time. */
export async function everySecondSkipJob(
  fx: IntegrationFixture,
  name: string,
): Promise<{ id: string; first: Date }> {
  const first = await nextWholeSecond(fx.db.pool, 500);
  const { rows } = await fx.db.pool.query<{ id: string }>(
    `INSERT INTO jobs (name, schedule, target, misfire, timeout_ms, next_run_at)
     VALUES ($1, '* * * * * *', $2, 'skip', 5000, $3) RETURNING id`,
    [name, { url: `${fx.target.url}/${name}`, method: 'POST' }, first],
  );
  return { id: rows[0]!.id, first };
}

export interface LateRun {
  scheduledFor: Date;
  state: string;
  reason: string | null;
  createdEpoch: string;
}

/**
 * No worker for 5 s while the leader dispatches an every-second `skip` job (its runs pile up, the
 * first ones late by more than `thresholdMs`), then one worker starts with `workerEnv` (on top of
 * `settings`). Returns the runs that were already late when the worker started, once settled.
 */
export async function lateRunsAfterWorker(
  fx: IntegrationFixture,
  options: {
    job: string;
    workerName: string;
    workerEnv: Record<string, string>;
    settings: Record<string, string>;
    thresholdMs: number;
  },
): Promise<LateRun[]> {
  const { id, first } = await everySecondSkipJob(fx, options.job);
  await sleep(first.getTime() + 5000 - Date.now());
  const workerStart = new Date();
  const worker = await fx.start(
    options.workerName,
    { ...options.settings, HELIOS_ROLES: 'worker,api', ...options.workerEnv },
    { worker: true },
  );
  const lateBefore = new Date(workerStart.getTime() - options.thresholdMs - 500);
  await waitFor(
    'the late runs settled',
    async () =>
      (
        await fx.db.pool.query(
          `SELECT 1 FROM runs WHERE job_id = $1 AND scheduled_for < $2 AND state IN ('queued', 'running')`,
          [id, lateBefore],
        )
      ).rowCount === 0,
    20_000,
    100,
  );
  const { rows } = await fx.db.pool.query<LateRun>(
    `SELECT scheduled_for AS "scheduledFor", state, reason, created_epoch::text AS "createdEpoch"
     FROM runs WHERE job_id = $1 AND scheduled_for < $2 ORDER BY scheduled_for`,
    [id, lateBefore],
  );
  await fx.db.pool.query('UPDATE jobs SET enabled = false WHERE id = $1', [id]);
  worker.node.signal('SIGTERM');
  await worker.node.exited;
  return rows;
}

/**
 * Resolves once the fence holds a token above every epoch that made a run of job `jobId`: the
 * leader of a cluster back from an outage has written, so workers started now judge the runs made
 * before the outage as of an ended epoch (store/runs.ts misfiredAtClaim). Fails after 10 s.
 */
export async function untilNewEpochWrote(fx: IntegrationFixture, jobId: string): Promise<void> {
  await waitFor(
    'the new epoch’s first write',
    async () =>
      (
        await fx.db.pool.query(
          'SELECT 1 FROM leader_fence WHERE token > (SELECT max(created_epoch) FROM runs WHERE job_id = $1)',
          [jobId],
        )
      ).rowCount === 1,
    10_000,
    50,
  );
}
