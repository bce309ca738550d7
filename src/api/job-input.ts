import { isDeepStrictEqual } from 'node:util';
import { InvalidCronError, parseCron, type CronSchedule } from '../scheduling/cron.js';
import { checkTargetUrl, type TargetPolicy } from '../security/target-policy.js';
import { REDACTED } from '../security/sensitive-headers.js';
import { headerProblem, isReservedHeader } from '../security/http-headers.js';
import { isUuid, type StoredTarget } from '../model.js';
import type { JobFields, JobRecord } from '../store/jobs.js';
import { MAX_INSERT_BYTES, RUN_ROW_BYTES } from '../store/dispatch.js';
import { badRequest, type FieldError } from './problems.js';
import { JOB_DEFAULTS, type JobInput } from './schemas.js';

/** The rules a job must pass beyond its schema. */
export interface JobRules {
  readonly targetPolicy: TargetPolicy;
  /** Lower-case names of headers whose values are never shown. */
  readonly sensitiveHeaders: ReadonlySet<string>;
}

export { isUuid };

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;
const unstorable = (text: string) => text.includes('\u0000') || LONE_SURROGATE.test(text);

/** Largest JSON-encoded `target.body`, and its deepest nesting (PostgreSQL's jsonb parser recurses). */
const MAX_BODY_BYTES = 65_536;
const MAX_BODY_DEPTH = 32;

/**
 * Most bytes a `fire-all` catch-up may write, counting each run's copy of the job's target (as
 * JSON text, which is never smaller than what PostgreSQL stores): two of the dispatcher's 16 MiB
 * statements. A catch-up goes whole in one dispatch pass while on-time jobs wait for it, and
 * 10,000 runs of a 250 KiB target would be 2.5 GB: minutes of inserts.
 */
export const MAX_CATCH_UP_BYTES = 2 * MAX_INSERT_BYTES;

/**
 * The most occurrences a `fire-all` job may catch up when its target takes `targetBytes` as
 * JSON: a 400 on `maxCatchUp` past it.
 */
export function maxCatchUpFor(targetBytes: number): number {
  return Math.max(1, Math.floor(MAX_CATCH_UP_BYTES / (RUN_ROW_BYTES + targetBytes)));
}

/** Nesting depth of a JSON value, counted without recursion and given up past `max`. */
function depthExceeds(value: unknown, max: number): boolean {
  const stack: [unknown, number][] = [[value, 0]];
  while (stack.length > 0) {
    const [current, depth] = stack.pop()!;
    if (current === null || typeof current !== 'object') continue;
    if (depth >= max) return true;
    for (const inner of Object.values(current)) stack.push([inner, depth + 1]);
  }
  return false;
}

/**
 * Values that cannot be stored as sent: strings (and object keys) PostgreSQL refuses (NUL, and
 * lone UTF-16 surrogates, not valid UTF-8), and numbers JSON.parse read as ±Infinity (past
 * ±1.8e308), which JSON.stringify would have written as null. Only called on values whose depth
 * is bounded.
 */
function unstorableValues(value: unknown, path: string[], out: FieldError[]): void {
  if (typeof value === 'string') {
    if (unstorable(value)) {
      out.push({ field: path.join('.'), message: 'must not contain NUL or unpaired surrogate characters' });
    }
  } else if (typeof value === 'number') {
    if (!Number.isFinite(value)) {
      out.push({
        field: path.join('.'),
        message: 'must be a finite number (a JSON number past ±1.8e308 cannot be kept)',
      });
    }
  } else if (value !== null && typeof value === 'object') {
    for (const [key, inner] of Object.entries(value)) {
      if (unstorable(key)) out.push({ field: path.join('.'), message: 'has a key that cannot be stored' });
      unstorableValues(inner, [...path, key], out);
    }
  }
}

function checkBody(body: unknown, method: string, errors: FieldError[]): void {
  if (body === undefined) return;
  const field = 'target.body';
  if (method === 'GET' || method === 'HEAD') {
    errors.push({ field, message: `a ${method} request cannot have a body` });
  } else if (depthExceeds(body, MAX_BODY_DEPTH)) {
    errors.push({ field, message: `must not be nested deeper than ${MAX_BODY_DEPTH} levels` });
  } else if (Buffer.byteLength(JSON.stringify(body)) > MAX_BODY_BYTES) {
    errors.push({ field, message: `must be at most ${MAX_BODY_BYTES} bytes as JSON` });
  } else {
    unstorableValues(body, [field], errors);
  }
}

/**
 * `value` as PostgreSQL shows it once stored in a `real` (float4), the type of
 * backoff_multiplier: the shortest decimal that reads back as the same float4.
 */
function shownAsReal(value: number): number {
  const stored = Math.fround(value);
  for (let digits = 1; digits < 9; digits++) {
    const shown = Number(stored.toPrecision(digits));
    if (Math.fround(shown) === stored) return shown;
  }
  return Number(stored.toPrecision(9));
}

/**
 * True when a `real` column gives `value` back as sent: 1.23456789 came back as 1.2345679 (and
 * `helios apply` of it found the job changed on every run).
 */
const keptAsReal = (value: number) => shownAsReal(value) === value;

/** Adds the problem of a time zone, if it has one (with an expression that has none). */
function zoneProblem(timezone: string, errors: FieldError[]): void {
  try {
    parseCron('* * * * *', timezone);
  } catch (err) {
    if (!(err instanceof InvalidCronError)) throw err;
    errors.push({ field: err.field, message: err.message });
  }
}

/** The origin (scheme, host, port) of a URL, or null when it does not parse. */
function originOf(url: string | undefined): string | null {
  if (url === undefined) return null;
  try {
    return new URL(url).origin;
  } catch {
    return null;
  }
}

function checkHeaders(
  headers: Readonly<Record<string, string>>,
  url: string,
  rules: JobRules,
  stored: StoredTarget | undefined,
  errors: FieldError[],
): Record<string, string> {
  const out: Record<string, string> = {};
  const seen = new Set<string>();
  // A stored secret was given for one origin; "***" must not carry it to another one.
  const sameOrigin = stored !== undefined && originOf(url) !== null && originOf(url) === originOf(stored.url);
  for (const [name, value] of Object.entries(headers)) {
    const field = `target.headers.${name}`;
    const lower = name.toLowerCase();
    if (seen.has(lower)) errors.push({ field, message: 'is given twice (header names ignore case)' });
    seen.add(lower);
    if (isReservedHeader(name)) {
      errors.push({ field, message: 'is set by Helios or the HTTP client and cannot be configured' });
    }
    const problem = headerProblem(name, value);
    if (problem) errors.push({ field, message: problem });
    if (rules.sensitiveHeaders.has(lower) && value === REDACTED) {
      // "***" is what reads return: sending it back means "keep the stored secret".
      const kept = Object.entries(stored?.headers ?? {}).find(([n]) => n.toLowerCase() === lower)?.[1];
      if (kept === undefined) {
        errors.push({ field, message: `"${REDACTED}" keeps a stored value, and none is stored` });
      } else if (!sameOrigin) {
        errors.push({
          field,
          message: `"${REDACTED}" keeps the value stored for ${originOf(stored?.url) ?? 'another origin'}; a new origin needs the value sent again`,
        });
      }
      out[name] = kept ?? value;
    } else {
      out[name] = value;
    }
  }
  return out;
}

/**
 * Checks what the schema cannot (cron, zone, URL and target policy, headers) and fills defaults.
 * `current` is the job as stored, on an update: its target for "***" header values, and its
 * catch-up bound, which an update that keeps target, misfire and maxCatchUp as they are does not
 * check again (a job stored before the bound may still be paused or renamed).
 * @throws ProblemError (400) listing every failing field.
 */
export function compileJob(
  input: JobInput,
  rules: JobRules,
  current?: Pick<JobRecord, 'target' | 'misfire' | 'maxCatchUp'>,
): { fields: Omit<JobFields, 'nextRunAt'>; schedule: CronSchedule } {
  const errors: FieldError[] = [];
  // The body is checked on its own (bounded depth first); everything else has a fixed shape.
  const { body: rawBody, ...targetRest } = input.target;
  const body = rawBody === null ? undefined : rawBody;
  unstorableValues({ ...input, target: targetRest }, [], errors);
  if (isUuid(input.name)) errors.push({ field: 'name', message: 'must not look like a job id (a UUID)' });
  const timezone = input.timezone ?? JOB_DEFAULTS.timezone;
  let schedule: CronSchedule | undefined;
  try {
    schedule = parseCron(input.schedule, timezone);
  } catch (err) {
    if (!(err instanceof InvalidCronError)) throw err;
    errors.push({ field: err.field, message: err.message });
    // parseCron stops at the expression's problem: the zone is checked on its own too.
    if (err.field === 'schedule') zoneProblem(timezone, errors);
  }
  const urlProblem = checkTargetUrl(input.target.url, rules.targetPolicy);
  if (urlProblem) errors.push({ field: 'target.url', message: urlProblem });
  const headers = checkHeaders(input.target.headers ?? {}, input.target.url, rules, current?.target, errors);
  const method =
    input.target.method ?? (body === undefined ? JOB_DEFAULTS.method : JOB_DEFAULTS.methodWithBody);
  checkBody(body, method, errors);
  const target: StoredTarget = {
    // Stored as parsed (lower-case host, default port dropped, path and query percent-encoded):
    // what is shown and what the worker connects to are then the same string.
    url: urlProblem ? input.target.url : new URL(input.target.url).href,
    method,
    headers,
    ...(body !== undefined ? { body } : {}),
  };
  const misfire = input.misfire ?? JOB_DEFAULTS.misfire;
  const maxCatchUp = input.maxCatchUp ?? JOB_DEFAULTS.maxCatchUp;
  const catchUpKept =
    current !== undefined &&
    current.misfire === misfire &&
    current.maxCatchUp === maxCatchUp &&
    isDeepStrictEqual(current.target, target);
  if (misfire === 'fire-all' && !catchUpKept) {
    // Measured as stored, so an update that keeps the target measures what its create measured.
    const targetBytes = Buffer.byteLength(JSON.stringify(target));
    const fits = maxCatchUpFor(targetBytes);
    if (maxCatchUp > fits) {
      errors.push({
        field: 'maxCatchUp',
        message: `with fire-all and a target of ${Math.ceil(targetBytes / 1024)} KiB, at most ${fits} (each run keeps a copy of the target, and a catch-up may write ${MAX_CATCH_UP_BYTES / 1024 / 1024} MiB)`,
      });
    }
  }
  const retry = { ...JOB_DEFAULTS.retry, ...input.retry };
  if (!keptAsReal(retry.backoffMultiplier)) {
    errors.push({
      field: 'retry.backoffMultiplier',
      message: `has more digits than are kept (about 7 significant: ${shownAsReal(retry.backoffMultiplier)} would be stored)`,
    });
  }
  if (errors.length > 0 || !schedule) throw badRequest(errors);

  const fields = {
    name: input.name,
    schedule: input.schedule,
    timezone,
    target,
    timeoutMs: input.timeoutMs ?? JOB_DEFAULTS.timeoutMs,
    maxAttempts: retry.maxAttempts,
    backoffMs: retry.backoffMs,
    backoffMultiplier: retry.backoffMultiplier,
    concurrency: input.concurrency ?? JOB_DEFAULTS.concurrency,
    misfire,
    maxCatchUp,
    enabled: input.enabled ?? JOB_DEFAULTS.enabled,
  };
  return { fields, schedule };
}

/** A stored job in input form (secrets included: server-side only), the base a PATCH applies to. */
export function inputOf(job: JobRecord): JobInput {
  return {
    name: job.name,
    schedule: job.schedule,
    timezone: job.timezone,
    target: {
      url: job.target.url,
      method: job.target.method as JobInput['target']['method'],
      headers: { ...job.target.headers },
      ...(job.target.body !== undefined && job.target.body !== null ? { body: job.target.body } : {}),
    },
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
  };
}
