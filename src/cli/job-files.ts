import { readdir, readFile, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { isDeepStrictEqual } from 'node:util';
import { JOB_DEFAULTS, type Job } from '../api/schemas.js';
import type { ApiClient } from './client.js';
import { ApiError } from './client.js';

/** A job file could not be read or is not a JSON job object (or array of them). */
export class JobFileError extends Error {
  override name = 'JobFileError';
}

type JobDocument = Record<string, unknown> & { name: string };

async function readText(path: string): Promise<string> {
  if (path !== '-') return readFile(path, 'utf8');
  const chunks: Buffer[] = [];
  for await (const chunk of process.stdin) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks).toString('utf8');
}

/**
 * Reads job documents from a file, from every `*.json` file of a folder (in name order), or from
 * stdin (`-`). A file holds one job object or an array of them.
 */
export async function readJobDocuments(path: string): Promise<{ source: string; job: JobDocument }[]> {
  const files =
    path !== '-' && (await stat(path).catch(() => null))?.isDirectory()
      ? (await readdir(path))
          .filter((f) => f.endsWith('.json'))
          .sort()
          .map((f) => join(path, f))
      : [path];
  const documents: { source: string; job: JobDocument }[] = [];
  for (const file of files) {
    let text: string;
    try {
      text = await readText(file);
    } catch (err) {
      throw new JobFileError(`${file}: ${err instanceof Error ? err.message : String(err)}`);
    }
    let parsed: unknown;
    try {
      parsed = JSON.parse(text);
    } catch (err) {
      throw new JobFileError(`${file}: ${jsonProblem(err, text)}`);
    }
    for (const [index, job] of (Array.isArray(parsed) ? parsed : [parsed]).entries()) {
      const where = Array.isArray(parsed) ? `${file}[${index}]` : file;
      if (typeof job !== 'object' || job === null || Array.isArray(job)) {
        throw new JobFileError(`${where}: a job must be a JSON object`);
      }
      if (typeof (job as { name?: unknown }).name !== 'string') {
        throw new JobFileError(`${where}: field "name" must be a string`);
      }
      documents.push({ source: where, job: job as JobDocument });
    }
  }
  return documents;
}

/**
 * The document with every omitted field set to its default, so that PATCHing it makes the stored
 * job equal the file. `enabled` is left out when the file omits it: pausing a job by hand
 * survives the next apply.
 */
function completed(doc: JobDocument): Record<string, unknown> {
  const { enabled, ...rest } = doc;
  const retry = typeof doc.retry === 'object' && doc.retry !== null ? doc.retry : {};
  return {
    timezone: JOB_DEFAULTS.timezone,
    timeoutMs: JOB_DEFAULTS.timeoutMs,
    concurrency: JOB_DEFAULTS.concurrency,
    misfire: JOB_DEFAULTS.misfire,
    maxCatchUp: JOB_DEFAULTS.maxCatchUp,
    ...rest,
    retry: { ...JOB_DEFAULTS.retry, ...retry },
    ...(enabled === undefined ? {} : { enabled }),
  };
}

/** The fields of `job` that the document sets, in the document's completed form. */
function differs(job: Job, doc: Record<string, unknown>): boolean {
  const target = doc.target as
    { url?: unknown; method?: string; headers?: object; body?: unknown } | undefined;
  const hasBody = target?.body !== undefined && target.body !== null;
  // The API stores a URL in its parsed form; compare the file's the same way.
  const url =
    typeof target?.url === 'string' && URL.canParse(target.url) ? new URL(target.url).href : target?.url;
  const expectedTarget = target && {
    ...target,
    url,
    method: target.method ?? (hasBody ? JOB_DEFAULTS.methodWithBody : JOB_DEFAULTS.method),
    headers: target.headers ?? {},
  };
  if (target && !hasBody) delete (expectedTarget as { body?: unknown }).body;
  const expected = { ...doc, target: expectedTarget };
  // Secret header values come back as "***", so a job with secrets always counts as changed.
  return Object.entries(expected).some(
    ([key, value]) => !isDeepStrictEqual((job as Record<string, unknown>)[key], value),
  );
}

export type ApplyOutcome = 'created' | 'updated' | 'unchanged';

/** Creates the job, or updates the job of the same name to match the document; idempotent. */
export async function applyJob(
  client: ApiClient,
  doc: JobDocument,
): Promise<{ outcome: ApplyOutcome; job: Job }> {
  let current: Job | null = null;
  try {
    current = await client.getJob(doc.name);
  } catch (err) {
    if (!(err instanceof ApiError && err.status === 404)) throw err;
  }
  if (current === null) return { outcome: 'created', job: await client.createJob(doc) };
  const desired = completed(doc);
  if (!differs(current, desired)) return { outcome: 'unchanged', job: current };
  const job = await client.patchJob(current.id, desired);
  return { outcome: 'updated', job };
}

/**
 * What is wrong with a job file that is not JSON, and where, without quoting it: V8's message
 * quotes the text around an unexpected token, which in a job file may be a secret (an unquoted
 * template placeholder filled with an API key).
 */
function jsonProblem(err: unknown, text: string): string {
  const message = err instanceof Error ? err.message : '';
  const at = / in JSON at position (\d+)/.exec(message);
  if (!at) return 'not valid JSON (an unexpected token: a value left unquoted?)';
  const before = text.slice(0, Number(at[1]));
  const line = before.split('\n').length;
  const column = before.length - before.lastIndexOf('\n');
  return `not valid JSON: ${message.slice(0, at.index)} at line ${line}, column ${column}`;
}
