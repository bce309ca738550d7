import { REDACTED, redactHeaders } from '../security/sensitive-headers.js';
import type { StoredTarget } from '../model.js';
import type { JobRecord } from '../store/jobs.js';
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

/** A URL with its query string and fragment replaced by `***` (webhook URLs often carry the secret there). */
export function maskUrlQuery(url: string): string {
  const cut = url.search(/[?#]/);
  if (cut === -1) return url;
  return `${url.slice(0, cut)}${url[cut]}${REDACTED}`;
}

type Masked = { target?: { url?: unknown }; attempts?: { responseExcerpt?: unknown }[] };

function maskOne(view: Masked): Masked {
  const out: Masked = { ...view };
  if (view.target && typeof view.target.url === 'string') {
    out.target = { ...view.target, url: maskUrlQuery(view.target.url) };
  }
  if (Array.isArray(view.attempts)) {
    out.attempts = view.attempts.map((a) =>
      a.responseExcerpt === null || a.responseExcerpt === undefined ? a : { ...a, responseExcerpt: REDACTED },
    );
  }
  return out;
}

/**
 * What a viewer may see of a response body made by the views above: target URLs without their
 * query string and attempts without their response excerpt (a response can echo a credential or
 * carry a token it issued). Applied to every /api/v1 response of a viewer, whatever the route.
 */
export function viewerView(payload: unknown): unknown {
  if (payload === null || typeof payload !== 'object') return payload;
  const page = payload as { items?: unknown };
  if (Array.isArray(page.items)) return { ...page, items: page.items.map((item) => viewerView(item)) };
  return maskOne(payload as Masked);
}
