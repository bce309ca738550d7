import type { Api, ApiOptions } from '../context.js';
import { COMMON_PROBLEMS, problems } from '../context.js';
import { pauseJob, resumeJob } from '../../jobs/commands.js';
import { createManualRun } from '../../store/manual-run.js';
import { notFound, ProblemError } from '../problems.js';
import { IdParams, Job, RunCreated } from '../schemas.js';
import { jobView } from '../views.js';
import { requireJob } from './job-ref.js';

/** POST /jobs/{id}/trigger, /pause, /resume. */
export function jobActionRoutes(app: Api, options: ApiOptions): void {
  const { pool, sensitiveHeaders, runsTopic } = options;
  const commands = {
    runsTopic,
    misfireThresholdMs: options.misfireThresholdMs ?? 5000,
    logger: options.logger,
  };

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
          'Occurrences due until now still run; later ones do not: runs created ahead of their time and not claimed are withdrawn. Runs already claimed or executing finish.',
        params: IdParams,
        response: { 200: Job, ...problems(404, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const { id } = await requireJob(pool, request.params.id);
      const job = await pauseJob(pool, { id }, commands);
      if (!job) throw notFound(`job "${request.params.id}"`);
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
      const { id } = await requireJob(pool, request.params.id);
      const job = await resumeJob(pool, { id });
      if (!job) throw notFound(`job "${request.params.id}"`);
      return jobView(job, sensitiveHeaders);
    },
  );
}
