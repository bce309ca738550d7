import type { Queryable } from '../../store/db.js';
import { findJob, type JobRecord } from '../../store/jobs.js';
import { isUuid } from '../job-input.js';
import { notFound } from '../problems.js';
import { NAME_PATTERN } from '../schemas.js';

const NAME = new RegExp(NAME_PATTERN);

/**
 * The job a `{id}` path segment names: a job id, or (for people and `helios apply`) a job name.
 * Names never look like UUIDs (rejected at save), so the two cannot be confused.
 * @throws ProblemError 404 when there is no such job.
 */
export async function requireJob(db: Queryable, idOrName: string, forUpdate = false): Promise<JobRecord> {
  const ref = isUuid(idOrName)
    ? { id: idOrName.toLowerCase() }
    : NAME.test(idOrName)
      ? { name: idOrName }
      : null;
  const job = ref && (await findJob(db, ref, forUpdate));
  if (!job) throw notFound(`job "${idOrName}"`);
  return job;
}
