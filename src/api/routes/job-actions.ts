import type { Api, ApiOptions } from '../context.js';
import { commandOptions, COMMON_PROBLEMS, problems } from '../context.js';
import { pauseJob, resumeJob, triggerJob } from '../../jobs/commands.js';
import { triggeredRun } from '../command-answers.js';
import { notFound } from '../problems.js';
import { IdParams, Job, RunCreated } from '../schemas.js';
import { jobView } from '../views.js';
import { jobRef } from './job-ref.js';

/** POST /jobs/{id}/trigger, /pause, /resume. */
export function jobActionRoutes(app: Api, options: ApiOptions): void {
  const { pool, sensitiveHeaders } = options;
  const commands = commandOptions(options);

  app.post(
    '/jobs/:id/trigger',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Run a job now',
        description:
          'Creates a run with scheduled_for = now() (a millisecond later when now() falls in the first millisecond of a second: whole seconds are the occurrences\' instants) and trigger "manual", and its dispatch message, in one transaction. A trigger whose instant another trigger of the job took is made a microsecond after it. Paused jobs can be triggered. 404 when the job does not exist, or was deleted before its run could be written; 409 when other triggers of the job kept taking its instant: nothing was written, try again.',
        params: IdParams,
        response: { 202: RunCreated, ...problems(404, 409, ...COMMON_PROBLEMS) },
      },
    },
    async (request, reply) => {
      const result = await triggerJob(pool, jobRef(request.params.id), commands);
      return reply.code(202).send(triggeredRun(result, request.params.id));
    },
  );

  app.post(
    '/jobs/:id/pause',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Disable a job',
        description:
          "Occurrences due until now still run; later ones do not: runs created ahead of their time whose call has not begun are withdrawn, claimed ahead by a worker or not. Runs whose call has begun finish. 409 concurrent-change when the job's runs stayed held by workers for 30 s, or the write met another in PostgreSQL: nothing was written, try again.",
        params: IdParams,
        response: { 200: Job, ...problems(404, 409, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const job = await pauseJob(pool, jobRef(request.params.id), commands);
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
      const job = await resumeJob(pool, jobRef(request.params.id));
      if (!job) throw notFound(`job "${request.params.id}"`);
      return jobView(job, sensitiveHeaders);
    },
  );
}
