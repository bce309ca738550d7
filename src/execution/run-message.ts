import { isUuid, type RunMessage } from '../model.js';

export type { RunMessage };

/** A message that is not a run announcement; it is logged and dropped, never retried. */
export class InvalidRunMessageError extends Error {
  override name = 'InvalidRunMessageError';
}

function date(value: unknown, field: string): Date {
  const parsed = typeof value === 'string' ? new Date(value) : new Date(NaN);
  if (Number.isNaN(parsed.getTime())) throw new InvalidRunMessageError(`${field} is not a timestamp`);
  return parsed;
}

/** Parses and validates a message value (JSON). */
export function parseRunMessage(value: string | null): RunMessage {
  if (value === null) throw new InvalidRunMessageError('empty message');
  let raw: unknown;
  try {
    raw = JSON.parse(value);
  } catch {
    throw new InvalidRunMessageError('message is not JSON');
  }
  if (typeof raw !== 'object' || raw === null) throw new InvalidRunMessageError('message is not an object');
  const m = raw as Record<string, unknown>;
  if (typeof m.runId !== 'string' || !isUuid(m.runId)) throw new InvalidRunMessageError('runId');
  if (typeof m.jobId !== 'string' || !isUuid(m.jobId)) throw new InvalidRunMessageError('jobId');
  if (typeof m.attempt !== 'number' || !Number.isInteger(m.attempt) || m.attempt < 1) {
    throw new InvalidRunMessageError('attempt');
  }
  const scheduledFor = date(m.scheduledFor, 'scheduledFor');
  // Older producers may omit notBefore: the first attempt is due when scheduled.
  const notBefore = m.notBefore === undefined ? scheduledFor : date(m.notBefore, 'notBefore');
  return { runId: m.runId, jobId: m.jobId, attempt: m.attempt, scheduledFor, notBefore };
}
