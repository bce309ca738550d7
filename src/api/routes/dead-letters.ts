import { Type } from 'typebox';
import type { Api, ApiOptions } from '../context.js';
import { COMMON_PROBLEMS, problems } from '../context.js';
import { replayDeadLetter } from '../../jobs/commands.js';
import { listDeadLetters, type DeadLetterRecord } from '../../store/dead-letter-list.js';
import { decodeCursor, DEFAULT_LIMIT, readPage } from '../cursor.js';
import { replayedRun } from '../command-answers.js';
import { DeadLetter, IdParams, Page, PageQuery, RunCreated } from '../schemas.js';

const DeadLettersQuery = Type.Object(
  {
    ...PageQuery.properties,
    open: Type.Optional(Type.Boolean({ description: 'true: only those not replayed yet; default all' })),
  },
  { additionalProperties: false },
);

function deadLetterView(letter: DeadLetterRecord): DeadLetter {
  return {
    id: letter.id,
    runId: letter.runId,
    jobId: letter.jobId,
    jobName: letter.jobName,
    attempt: letter.attempt,
    error: letter.error,
    statusCode: letter.statusCode,
    createdAt: letter.createdAt.toISOString(),
    replayedAt: letter.replayedAt?.toISOString() ?? null,
    replayCount: letter.replayCount,
  };
}

/** GET /dead-letters, POST /dead-letters/{id}/replay. */
export function deadLetterRoutes(app: Api, options: ApiOptions): void {
  const { pool, runsTopic } = options;

  app.get(
    '/dead-letters',
    {
      schema: {
        tags: ['dead-letters'],
        summary: 'Dead letters, newest first',
        querystring: DeadLettersQuery,
        response: { 200: Page(DeadLetter), ...problems(400, ...COMMON_PROBLEMS) },
      },
    },
    async (request) => {
      const limit = request.query.limit ?? DEFAULT_LIMIT;
      const open = request.query.open ?? null;
      return readPage(
        (before, count) => listDeadLetters(pool, { before, open, limit: count }),
        decodeCursor(request.query.cursor),
        limit,
        deadLetterView,
      );
    },
  );

  app.post(
    '/dead-letters/:id/replay',
    {
      schema: {
        tags: ['dead-letters'],
        summary: 'Re-queue a dead run as a new attempt',
        description:
          'The run goes back to queued with a fresh budget of the job’s max attempts, due now, in one transaction with its dispatch message. 409 when the dead letter was already replayed.',
        params: IdParams,
        response: { 202: RunCreated, ...problems(404, 409, ...COMMON_PROBLEMS) },
      },
    },
    async (request, reply) => {
      const { id } = request.params;
      const result = await replayDeadLetter(pool, id, { runsTopic });
      return reply.code(202).send(replayedRun(result, id));
    },
  );
}
