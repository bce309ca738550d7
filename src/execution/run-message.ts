import { CONCURRENCY_POLICIES, isUuid, type ConcurrencyPolicy, type RunMessage } from '../model.js';

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
  return toRunMessage(parseJson(value));
}

/**
 * Parses a hand-off payload (store/handoff.ts), `{ to?, runs: [run message…] }`, for node `self`:
 * the runs, or none when it is addressed to another node. Items that are not run messages are
 * left out; a payload of another shape is an InvalidRunMessageError.
 */
export function parseHandOff(value: string, self: string): RunMessage[] {
  const raw = parseJson(value) as { to?: unknown; runs?: unknown } | null;
  if (typeof raw !== 'object' || raw === null || !Array.isArray(raw.runs)) {
    throw new InvalidRunMessageError('hand-off payload has no runs');
  }
  if (raw.to !== undefined && raw.to !== self) return [];
  const messages: RunMessage[] = [];
  for (const item of raw.runs) {
    try {
      messages.push(toRunMessage(item));
    } catch {
      // One unusable item costs only itself: the claim is what makes a run ours anyway.
    }
  }
  return messages;
}

function parseJson(value: string): unknown {
  try {
    return JSON.parse(value);
  } catch {
    throw new InvalidRunMessageError('message is not JSON');
  }
}

function toRunMessage(raw: unknown): RunMessage {
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
  const message: { -readonly [K in keyof RunMessage]: RunMessage[K] } = {
    runId: m.runId,
    jobId: m.jobId,
    attempt: m.attempt,
    scheduledFor,
    notBefore,
  };
  if (m.timeoutMs !== undefined) {
    if (typeof m.timeoutMs !== 'number' || !Number.isInteger(m.timeoutMs) || m.timeoutMs < 1) {
      throw new InvalidRunMessageError('timeoutMs');
    }
    message.timeoutMs = m.timeoutMs;
  }
  if (m.concurrency !== undefined) {
    if (!CONCURRENCY_POLICIES.includes(m.concurrency as ConcurrencyPolicy)) {
      throw new InvalidRunMessageError('concurrency');
    }
    message.concurrency = m.concurrency as ConcurrencyPolicy;
  }
  return message;
}
