import type { Api, ApiOptions } from '../context.js';
import { COMMON_PROBLEMS, problems } from '../context.js';
import { inTransaction } from '../../store/db.js';
import { databaseNow } from '../../store/dispatch.js';
import { skipFutureRuns, updateJob } from '../../store/jobs.js';
import { createManualRun } from '../../store/manual-run.js';
import { parseCron } from '../../scheduling/cron.js';
import { ProblemError } from '../problems.js';
import { IdParams, Job, RunCreated } from '../schemas.js';
import { jobView } from '../views.js';
import { requireJob } from './job-ref.js';

/** POST /jobs/{id}/trigger, /pause, /resume. */
export function jobActionRoutes(app: Api, options: ApiOptions): void {
  const { pool, sensitiveHeaders, runsTopic } = options;

  app.post(
    '/jobs/:id/trigger',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Run a job now',
        description:
          'Creates a run with scheduled_for = now() and trigger "manual", and its dispatch message, in one transaction. Paused jobs can be triggered.',
        params: IdParams,
        response: { 202: RunCreated, ...problems(404, 409, ...COMMON_PROBLEMS) },
      },
    },
    async (request, reply) => {
      const job = await requireJob(pool, request.params.id);
      const runId = await createManualRun(pool, job.id, runsTopic);
      if (runId === null) {
        // The job was deleted in between, or a run exists for this exact microsecond.
        throw new ProblemError(409, 'conflict', 'Conflict', 'no run was created; try again');
      }
      return reply.code(202).send({ runId });
    },
  );

  app.post(
    '/jobs/:id/pause',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Disable a job',
        description:
          'No new runs are created; runs created ahead of their time and not started are skipped (reason "paused"). Runs already executing finish.',
        params: IdParams,
        response: { 200: Job, ...problems(404, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const job = await inTransaction(pool, async (client) => {
        const current = await requireJob(client, request.params.id, true);
        if (!current.enabled) return current;
        const paused = await updateJob(client, current.id, { ...current, enabled: false });
        await skipFutureRuns(client, current.id);
        return paused!;
      });
      return jobView(job, sensitiveHeaders);
    },
  );

  app.post(
    '/jobs/:id/resume',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Enable a job',
        description:
          'nextRunAt becomes the first occurrence after now: occurrences missed while paused do not fire.',
        params: IdParams,
        response: { 200: Job, ...problems(404, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const job = await inTransaction(pool, async (client) => {
        const current = await requireJob(client, request.params.id, true);
        if (current.enabled) return current;
        const next = parseCron(current.schedule, current.timezone).next(await databaseNow(client));
        const resumed = await updateJob(client, current.id, { ...current, enabled: true, nextRunAt: next });
        return resumed!;
      });
      return jobView(job, sensitiveHeaders);
    },
  );
}
