import { redactHeaders } from '../security/sensitive-headers.js';
import type { JobRecord, StoredTarget } from '../store/jobs.js';
import type { AttemptRecord, RunDetail as RunDetailRecord, RunSummary } from '../store/run-history.js';
import type { Job, Run, RunDetail } from './schemas.js';

// Records → response bodies. Every target passes through here, so no response shows a secret.

const iso = (date: Date) => date.toISOString();
const isoOrNull = (date: Date | null) => (date === null ? null : date.toISOString());

function targetView(target: StoredTarget, sensitive: ReadonlySet<string>): Job['target'] {
  return {
    url: target.url,
    method: (target.method ?? 'GET') as Job['target']['method'],
    headers: redactHeaders(target.headers ?? {}, sensitive),
    ...(target.body !== undefined && target.body !== null ? { body: target.body } : {}),
  };
}

export function jobView(job: JobRecord, sensitive: ReadonlySet<string>): Job {
  return {
    id: job.id,
    name: job.name,
    schedule: job.schedule,
    timezone: job.timezone,
    target: targetView(job.target, sensitive),
    timeoutMs: job.timeoutMs,
    retry: {
      maxAttempts: job.maxAttempts,
      backoffMs: job.backoffMs,
      backoffMultiplier: job.backoffMultiplier,
    },
    concurrency: job.concurrency,
    misfire: job.misfire,
    maxCatchUp: job.maxCatchUp,
    enabled: job.enabled,
    nextRunAt: isoOrNull(job.nextRunAt),
    scheduleError: job.scheduleError,
    createdAt: iso(job.createdAt),
    updatedAt: iso(job.updatedAt),
  };
}

export function runView(run: RunSummary): Run {
  return {
    id: run.id,
    jobId: run.jobId,
    scheduledFor: iso(run.scheduledFor),
    trigger: run.trigger,
    state: run.state,
    attempt: run.attempt,
    maxAttempts: run.maxAttempts,
    notBefore: iso(run.notBefore),
    claimedBy: run.claimedBy,
    reason: run.reason,
    lastStatus: run.lastStatus,
    lastError: run.lastError,
    createdAt: iso(run.createdAt),
    startedAt: isoOrNull(run.startedAt),
    finishedAt: isoOrNull(run.finishedAt),
  };
}

export function runDetailView(
  run: RunDetailRecord,
  attempts: AttemptRecord[],
  sensitive: ReadonlySet<string>,
): RunDetail {
  return {
    ...runView(run),
    target: targetView(run.target, sensitive),
    timeoutMs: run.timeoutMs,
    claimExpiresAt: isoOrNull(run.claimExpiresAt),
    attempts: attempts.map((a) => ({
      attempt: a.attempt,
      nodeId: a.nodeId,
      startedAt: iso(a.startedAt),
      finishedAt: isoOrNull(a.finishedAt),
      outcome: a.outcome,
      statusCode: a.statusCode,
      durationMs: a.durationMs,
      error: a.error,
      responseExcerpt: a.responseExcerpt,
    })),
  };
}
