import type { Queryable } from '../../store/db.js';
import { findJob, type JobRecord, type JobRef } from '../../store/jobs.js';
import { isUuid } from '../../model.js';
import { notFound } from '../problems.js';
import { NAME_PATTERN } from '../schemas.js';

const NAME = new RegExp(NAME_PATTERN);

/**
 * The job a `{id}` path segment names: a job id, or (for people and `helios apply`) a job name.
 * Names never look like UUIDs (rejected at save), so the two cannot be confused.
 * @throws ProblemError 404 when the segment can name no job.
 */
export function jobRef(idOrName: string): JobRef {
  if (isUuid(idOrName)) return { id: idOrName.toLowerCase() };
  if (NAME.test(idOrName)) return { name: idOrName };
  throw notFound(`job "${idOrName}"`);
}

/** The job a `{id}` path segment names. @throws ProblemError 404 when there is no such job. */
export async function requireJob(db: Queryable, idOrName: string): Promise<JobRecord> {
  const job = await findJob(db, jobRef(idOrName));
  if (!job) throw notFound(`job "${idOrName}"`);
  return job;
}
