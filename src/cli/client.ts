import type { CliConfig } from '../config/index.js';
import type { Cluster, DeadLetter, Job, JobInput, JobPatch, Run, RunDetail } from '../api/schemas.js';

/** A problem body returned by the API (RFC 9457). */
export interface Problem {
  readonly type?: string;
  readonly title?: string;
  readonly status?: number;
  readonly detail?: string;
  readonly errors?: readonly { field: string; message: string }[];
}

/** The API answered with an error; `problem` is its body when it sent one. */
export class ApiError extends Error {
  override name = 'ApiError';
  constructor(
    readonly status: number,
    readonly problem: Problem,
  ) {
    super(problem.title ?? `HTTP ${status}`);
  }
}

/** The API could not be reached at all. */
export class UnreachableError extends Error {
  override name = 'UnreachableError';
}

/** A request body not checked here (the server checks it and answers a 400 problem). */
type UncheckedBody = Readonly<Record<string, unknown>>;

const seg = (value: string) => encodeURIComponent(value);

/** How long the CLI waits for an answer before it calls the API unreachable. */
const REQUEST_TIMEOUT_MS = 30_000;
/** A job's delete removes its history first, 10,000 runs a statement: give it ten minutes. */
const DELETE_TIMEOUT_MS = 600_000;

/**
 * A small typed JSON client of /api/v1, used by the CLI and exported by the programmatic API:
 * bearer token, problem bodies become ApiError. A job is named by its id or its name.
 */
export class ApiClient {
  constructor(private readonly config: CliConfig) {}

  listJobs(max?: number): Promise<Job[]> {
    return this.all<Job>('/jobs', max);
  }
  getJob(ref: string): Promise<Job> {
    return this.request<Job>('GET', `/jobs/${seg(ref)}`);
  }
  /** The server validates the body: a document read from a file is sent as it is. */
  createJob(input: JobInput | UncheckedBody): Promise<Job> {
    return this.request<Job>('POST', '/jobs', input);
  }
  patchJob(ref: string, patch: JobPatch | UncheckedBody): Promise<Job> {
    return this.request<Job>('PATCH', `/jobs/${seg(ref)}`, patch);
  }
  async deleteJob(ref: string): Promise<void> {
    // A job with a long history takes its time: 2M finished runs ≈ 40 s (docs/api.md, Jobs).
    await this.request('DELETE', `/jobs/${seg(ref)}`, undefined, DELETE_TIMEOUT_MS);
  }
  triggerJob(ref: string): Promise<{ runId: string }> {
    return this.request<{ runId: string }>('POST', `/jobs/${seg(ref)}/trigger`);
  }
  pauseJob(ref: string): Promise<Job> {
    return this.request<Job>('POST', `/jobs/${seg(ref)}/pause`);
  }
  resumeJob(ref: string): Promise<Job> {
    return this.request<Job>('POST', `/jobs/${seg(ref)}/resume`);
  }
  /** Runs of a job, newest first; `max` default all. */
  listRuns(ref: string, options: { state?: string; max?: number } = {}): Promise<Run[]> {
    const state = options.state ? `?state=${seg(options.state)}` : '';
    return this.all<Run>(`/jobs/${seg(ref)}/runs${state}`, options.max);
  }
  getRun(id: string): Promise<RunDetail> {
    return this.request<RunDetail>('GET', `/runs/${seg(id)}`);
  }
  listDeadLetters(options: { open?: boolean; max?: number } = {}): Promise<DeadLetter[]> {
    return this.all<DeadLetter>(`/dead-letters${options.open ? '?open=true' : ''}`, options.max);
  }
  replayDeadLetter(id: string): Promise<{ runId: string }> {
    return this.request<{ runId: string }>('POST', `/dead-letters/${seg(id)}/replay`);
  }
  cluster(): Promise<Cluster> {
    return this.request<Cluster>('GET', '/cluster');
  }

  async request<T>(method: string, path: string, body?: unknown, timeoutMs = REQUEST_TIMEOUT_MS): Promise<T> {
    // x-helios-client: an API without tokens takes writes only with a header a cross-site page
    // cannot send without a CORS preflight (a bodiless POST has no content-type to show).
    const headers: Record<string, string> = { accept: 'application/json', 'x-helios-client': 'cli' };
    if (this.config.apiToken) headers.authorization = `Bearer ${this.config.apiToken}`;
    if (body !== undefined) headers['content-type'] = 'application/json';
    let response: Response;
    try {
      response = await fetch(`${this.config.apiUrl}/api/v1${path}`, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.timeout(timeoutMs),
      });
    } catch (err) {
      const cause = err instanceof Error && err.cause instanceof Error ? `: ${err.cause.message}` : '';
      throw new UnreachableError(`cannot reach ${this.config.apiUrl} (HELIOS_API_URL)${cause}`);
    }
    const text = await response.text();
    const parsed: unknown = text ? safeJson(text) : null;
    if (!response.ok) {
      const problem =
        parsed && typeof parsed === 'object' ? (parsed as Problem) : { title: response.statusText };
      throw new ApiError(response.status, problem);
    }
    return parsed as T;
  }

  /** Follows `nextCursor` until `max` items (default all) were read. */
  async all<T>(path: string, max = Infinity): Promise<T[]> {
    const items: T[] = [];
    let cursor: string | null = null;
    do {
      const limit = Math.min(500, max - items.length);
      const separator = path.includes('?') ? '&' : '?';
      const query = `${separator}limit=${limit}${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ''}`;
      const page: { items: T[]; nextCursor: string | null } = await this.request('GET', `${path}${query}`);
      items.push(...page.items);
      cursor = page.nextCursor;
    } while (cursor && items.length < max);
    return items;
  }
}

function safeJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return { title: text.slice(0, 200) };
  }
}
