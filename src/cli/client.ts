import type { CliConfig } from '../config.js';

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

/** A small JSON client of /api/v1 for the CLI: bearer token, problem bodies become ApiError. */
export class ApiClient {
  constructor(private readonly config: CliConfig) {}

  async request<T>(method: string, path: string, body?: unknown): Promise<T> {
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
        signal: AbortSignal.timeout(30_000),
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
