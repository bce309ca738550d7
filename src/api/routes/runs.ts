import type { Api, ApiOptions } from '../context.js';
import { COMMON_PROBLEMS, problems } from '../context.js';
import { findRun, listRunsOfJob } from '../../store/run-history.js';
import { decodeCursor, DEFAULT_LIMIT, readPage } from '../cursor.js';
import { isUuid } from '../job-input.js';
import { notFound } from '../problems.js';
import { IdParams, Page, Run, RunDetail, RunsQuery } from '../schemas.js';
import { runDetailView, runView } from '../views.js';
import { requireJob } from './job-ref.js';

/** GET /jobs/{id}/runs (history, newest first) and GET /runs/{id} (one run with its attempts). */
export function runRoutes(app: Api, options: ApiOptions): void {
  const { pool, sensitiveHeaders } = options;

  app.get(
    '/jobs/:id/runs',
    {
      schema: {
        tags: ['jobs', 'runs'],
        summary: "A job's runs, newest occurrence first",
        params: IdParams,
        querystring: RunsQuery,
        response: { 200: Page(Run), ...problems(400, 404, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const job = await requireJob(pool, request.params.id);
      const limit = request.query.limit ?? DEFAULT_LIMIT;
      const state = request.query.state ?? null;
      return readPage(
        (before, count) => listRunsOfJob(pool, job.id, { before, state, limit: count }),
        decodeCursor(request.query.cursor),
        limit,
        runView,
      );
    },
  );

  app.get(
    '/runs/:id',
    {
      schema: {
        tags: ['runs'],
        summary: 'One run with its attempts',
        params: IdParams,
        response: { 200: RunDetail, ...problems(404, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const found = isUuid(request.params.id) ? await findRun(pool, request.params.id) : null;
      if (!found) throw notFound(`run "${request.params.id}"`);
      return runDetailView(found.run, found.attempts, sensitiveHeaders);
    },
  );
}
