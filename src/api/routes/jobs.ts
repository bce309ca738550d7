import { Type } from 'typebox';
import type { Api, ApiOptions } from '../context.js';
import { commandOptions, COMMON_PROBLEMS, problems } from '../context.js';
import { createJob, deleteJob, patchJob } from '../../jobs/commands.js';
import { listJobs } from '../../store/jobs.js';
import { compileJob, inputOf } from '../job-input.js';
import { decodeCursor, DEFAULT_LIMIT, readPage } from '../cursor.js';
import { IdParams, Job, JobInput, JobPatch, Page, PageQuery } from '../schemas.js';
import { jobView } from '../views.js';
import { jobRef, requireJob } from './job-ref.js';
import { notFound } from '../problems.js';

/**
 * Jobs a page reads from PostgreSQL at a time: each carries its target, up to the request body
 * limit, so a page of 500 is read in steps and stops once its bytes are reached (api/cursor.ts).
 */
export const JOB_PAGE_CHUNK = 32;

/** POST /jobs, GET /jobs, GET/PATCH/DELETE /jobs/{id}. */
export function jobRoutes(app: Api, options: ApiOptions): void {
  const { pool, sensitiveHeaders } = options;
  const commands = commandOptions(options);
  const view = (job: Parameters<typeof jobView>[0]) => jobView(job, sensitiveHeaders);

  app.post(
    '/jobs',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Create a job',
        description: 'nextRunAt is computed from the database clock. 409 when the name is taken.',
        body: JobInput,
        response: { 201: Job, ...problems(400, 409, 413, 415, ...COMMON_PROBLEMS) },
      },
    },
    async (request, reply) => {
      const job = await createJob(pool, compileJob(request.body, options));
      return reply.code(201).header('location', `/api/v1/jobs/${job.id}`).send(view(job));
    },
  );

  app.get(
    '/jobs',
    {
      schema: {
        tags: ['jobs'],
        summary: 'List jobs in creation order',
        querystring: PageQuery,
        response: { 200: Page(Job), ...problems(400, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const limit = request.query.limit ?? DEFAULT_LIMIT;
      const after = decodeCursor(request.query.cursor);
      return readPage((from, count) => listJobs(pool, from, count), after, limit, view, {
        chunk: JOB_PAGE_CHUNK,
      });
    },
  );

  app.get(
    '/jobs/:id',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Read a job (by id or name)',
        params: IdParams,
        response: { 200: Job, ...problems(404, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => view(await requireJob(pool, request.params.id)),
  );

  app.patch(
    '/jobs/:id',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Change some fields of a job',
        description:
          'Each given top-level field replaces the stored one whole. A sensitive header sent as "***" keeps its stored value. nextRunAt is recomputed when schedule or timezone change or the job is enabled again. Runs created ahead of their time and not started follow the change: they are created again from the new definition.',
        params: IdParams,
        body: JobPatch,
        response: { 200: Job, ...problems(400, 404, 409, 413, 415, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const job = await patchJob(
        pool,
        jobRef(request.params.id),
        (current) => compileJob({ ...inputOf(current), ...request.body }, options, current),
        commands,
      );
      if (!job) throw notFound(`job "${request.params.id}"`);
      return view(job);
    },
  );

  app.delete(
    '/jobs/:id',
    {
      schema: {
        tags: ['jobs'],
        summary: 'Delete a job with its runs',
        description:
          "409 concurrent-change when the job's runs stayed held by workers for 30 s, or the write met another in PostgreSQL: the job is still there (part of its finished runs may be deleted, and the answer says so); send the delete again to finish it.",
        params: IdParams,
        response: {
          204: Type.Null({ description: 'deleted' }),
          ...problems(404, 409, ...COMMON_PROBLEMS),
        },
      },
    },
    async (request, reply) => {
      if (!(await deleteJob(pool, jobRef(request.params.id)))) throw notFound(`job "${request.params.id}"`);
      return reply.code(204).send(null);
    },
  );
}
