import type { ReplayOutcome, TriggerResult } from '../jobs/commands.js';
import { conflict, notFound, ProblemError } from './problems.js';

// What a trigger or a replay answers, for the REST routes and JobUtils alike: both must give the
// same problem for the same outcome.

/** The run a trigger created. @throws ProblemError 404 (no such job), 409 (try again). */
export function triggeredRun(result: TriggerResult, jobRef: string): { runId: string } {
  if (result.outcome === 'no-job') throw notFound(`job "${jobRef}"`);
  if (result.outcome === 'conflict') {
    throw new ProblemError(409, 'conflict', 'Conflict', 'no run was created; try again');
  }
  return { runId: result.runId };
}

/** The run a replay re-queued. @throws ProblemError 404 (no such dead letter), 409 (already replayed). */
export function replayedRun(result: ReplayOutcome, deadLetterId: string): { runId: string } {
  if (result.outcome === 'no-dead-letter') throw notFound(`dead letter "${deadLetterId}"`);
  if (result.outcome === 'already-replayed') throw conflict('id', 'this dead letter was already replayed');
  return { runId: result.runId };
}
