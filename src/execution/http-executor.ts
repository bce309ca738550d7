import { performance } from 'node:perf_hooks';
import { Agent, request, type Dispatcher } from 'undici';
import { toError } from '../errors.js';
import {
  checkTargetUrl,
  compileTargetPolicy,
  guardedLookup,
  type TargetPolicy,
} from '../security/target-policy.js';
import type { AttemptReport } from '../store/attempts.js';
import type { ClaimedRun } from '../store/runs.js';

/** Options of {@link HttpExecutor}. */
export interface HttpExecutorOptions {
  /** At most this many bytes of a response body are read and kept; default 2048. */
  readonly maxExcerptBytes?: number;
  /** Idle keep-alive connections are closed after this long; default 4000 ms (undici's). */
  readonly keepAliveTimeoutMs?: number;
  /** Which target addresses may be called; default `compileTargetPolicy()` (metadata ranges denied). */
  readonly targetPolicy?: TargetPolicy;
}

/** What a call needs from a claimed run (the rest of a claimed run may come along). */
export type HttpCall = Pick<
  ClaimedRun,
  'id' | 'jobId' | 'attempt' | 'scheduledFor' | 'target' | 'timeoutMs'
> &
  Partial<ClaimedRun>;

const METHODS = new Set(['GET', 'HEAD', 'POST', 'PUT', 'PATCH', 'DELETE', 'OPTIONS']);
type Method = Dispatcher.HttpMethod;

/**
 * Executes one attempt of a run as an HTTP call through a keep-alive connection pool.
 * Never throws: every way a call can end becomes an {@link AttemptReport}. The body of the
 * response is read up to `maxExcerptBytes` and then destroyed, so a huge or endless response
 * costs a bounded amount of memory (the connection is then closed rather than reused).
 */
export class HttpExecutor {
  private readonly agent: Agent;
  private readonly maxExcerptBytes: number;
  private readonly policy: TargetPolicy;
  private readonly checkedUrls = new Map<string, string | null>();

  constructor(options: HttpExecutorOptions = {}) {
    this.maxExcerptBytes = options.maxExcerptBytes ?? 2048;
    this.policy = options.targetPolicy ?? compileTargetPolicy();
    this.agent = new Agent({
      keepAliveTimeout: options.keepAliveTimeoutMs ?? 4_000,
      // The run's own timeout (an AbortSignal) bounds every call; undici's 300 s defaults would
      // only ever fire for jobs with longer timeouts, which the schema allows up to an hour.
      headersTimeout: 0,
      bodyTimeout: 0,
      // Names are resolved and checked against the target policy on every new connection, so the
      // address checked is the address connected to (no DNS rebinding around the API's check).
      connect: { lookup: guardedLookup(this.policy) },
    });
  }

  /**
   * Calls the run's target. `cancel` aborts the call (replaced, claim lost, shutdown); the run's
   * `timeoutMs` aborts it too and is reported as outcome `timeout`.
   */
  async execute(run: HttpCall, cancel: AbortSignal): Promise<AttemptReport> {
    const started = performance.now();
    const elapsed = () => performance.now() - started;
    // One controller for both reasons to stop (cheaper per call than AbortSignal.any + timeout).
    const controller = new AbortController();
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      controller.abort(new Error(`timed out after ${run.timeoutMs} ms`));
    }, run.timeoutMs);
    const onCancel = () => controller.abort(cancel.reason);
    if (cancel.aborted) onCancel();
    else cancel.addEventListener('abort', onCancel, { once: true });
    try {
      const { url, method, headers, body } = this.prepare(run);
      const response = await request(url, {
        dispatcher: this.agent,
        method,
        headers,
        body,
        signal: controller.signal,
      });
      const excerpt = await this.readExcerpt(response.body);
      const ok = response.statusCode >= 200 && response.statusCode < 300;
      return {
        outcome: ok ? 'succeeded' : 'failed',
        statusCode: response.statusCode,
        durationMs: elapsed(),
        error: ok ? null : `HTTP ${response.statusCode}`,
        responseExcerpt: excerpt,
      };
    } catch (err) {
      if (timedOut) {
        return {
          outcome: 'timeout',
          statusCode: null,
          durationMs: elapsed(),
          error: `timed out after ${run.timeoutMs} ms`,
          responseExcerpt: null,
        };
      }
      const error = cancel.aborted ? toError(cancel.reason) : toError(err);
      return {
        outcome: cancel.aborted ? 'cancelled' : 'failed',
        statusCode: null,
        durationMs: elapsed(),
        error: describe(error),
        responseExcerpt: null,
      };
    } finally {
      clearTimeout(timer);
      cancel.removeEventListener('abort', onCancel);
    }
  }

  /** Closes pooled connections; calls still in flight are destroyed. */
  async close(): Promise<void> {
    await this.agent.destroy();
  }

  private prepare(run: HttpCall) {
    const target = run.target;
    if (typeof target?.url !== 'string') throw new Error('target.url is missing');
    // IP literals never reach the guarded lookup; check them (and the URL's shape) here. The
    // verdict depends only on the URL text and the fixed policy, so it is cached.
    let problem = this.checkedUrls.get(target.url);
    if (problem === undefined) {
      problem = checkTargetUrl(target.url, this.policy);
      if (this.checkedUrls.size >= 10_000) this.checkedUrls.clear();
      this.checkedUrls.set(target.url, problem);
    }
    if (problem) throw new Error(`target.url ${problem}`);
    const hasBody = target.body !== undefined && target.body !== null;
    const method = (target.method ?? (hasBody ? 'POST' : 'GET')).toUpperCase();
    if (!METHODS.has(method)) throw new Error(`target.method ${method} is not supported`);
    const headers: Record<string, string> = {};
    for (const [name, value] of Object.entries(target.headers ?? {}))
      headers[name.toLowerCase()] = String(value);
    if (hasBody) headers['content-type'] ??= 'application/json';
    // Ours last: a job cannot forge the identity of the call.
    Object.assign(headers, {
      'idempotency-key': run.id,
      'x-helios-job-id': run.jobId,
      'x-helios-run-id': run.id,
      'x-helios-scheduled-for': run.scheduledFor.toISOString(),
      'x-helios-attempt': String(run.attempt),
    });
    return {
      url: target.url,
      method: method as Method,
      headers,
      body: hasBody ? JSON.stringify(target.body) : undefined,
    };
  }

  /** Reads at most `maxExcerptBytes` of the body as UTF-8, then discards the rest. */
  private async readExcerpt(body: AsyncIterable<Buffer> & { destroy(): void }): Promise<string | null> {
    const chunks: Buffer[] = [];
    let size = 0;
    try {
      for await (const chunk of body) {
        chunks.push(chunk);
        size += chunk.length;
        // Leaving the loop early destroys the stream: nothing more is buffered.
        if (size >= this.maxExcerptBytes) break;
      }
    } finally {
      body.destroy();
    }
    if (size === 0) return null;
    return Buffer.concat(chunks).subarray(0, this.maxExcerptBytes).toString('utf8');
  }
}

/** An error message with its cause (undici puts the socket error there). */
function describe(error: Error): string {
  const cause = error.cause instanceof Error ? `: ${error.cause.message}` : '';
  return `${error.name}: ${error.message}${cause}`;
}
