import { performance } from 'node:perf_hooks';
import { Agent, errors as undiciErrors, Pool, type Dispatcher } from 'undici';
import { toError } from '../errors.js';
import {
  checkTargetUrl,
  compileTargetPolicy,
  guardedLookup,
  portOf,
  TargetDeniedError,
  type TargetPolicy,
} from '../security/target-policy.js';
import { headerProblem } from '../security/http-headers.js';
import type { AttemptReport, CallOutcome } from '../store/attempts.js';
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
  /** Per target URL: the policy's verdict on its text and, when allowed, its parts. */
  private readonly checkedUrls = new Map<string, { problem: string } | { origin: string; path: string }>();
  /** The cluster endpoints' generation the cached verdicts were made with. */
  private checkedGeneration = 0;

  constructor(options: HttpExecutorOptions = {}) {
    this.maxExcerptBytes = options.maxExcerptBytes ?? 2048;
    this.policy = options.targetPolicy ?? compileTargetPolicy();
    this.agent = new Agent({
      keepAliveTimeout: options.keepAliveTimeoutMs ?? 4_000,
      // The run's own timeout (an AbortSignal) bounds every call; undici's 300 s defaults would
      // only ever fire for jobs with longer timeouts, which the schema allows up to an hour.
      headersTimeout: 0,
      bodyTimeout: 0,
      // HTTP/1.1 only, as before undici 8 (which negotiates HTTP/2 over TLS by default): the
      // excerpt, close-on-huge-body and keep-alive behaviour measured and tested here is HTTP/1.1's.
      allowH2: false,
      // Names are resolved and checked against the target policy on every new connection, so the
      // address checked is the address connected to (no DNS rebinding around the API's check).
      // One pool per origin, each with a lookup that knows its port: the cluster's own servers
      // are refused by address and port.
      factory: (origin, opts) => {
        const port = portOf(new URL(String(origin)));
        const options = opts as Pool.Options;
        const connect = typeof options.connect === 'object' ? options.connect : {};
        return new Pool(origin, {
          ...options,
          connect: { ...connect, lookup: guardedLookup(this.policy, port) },
        });
      },
    });
  }

  /**
   * Calls the run's target. `cancel` aborts the call (replaced, claim lost, shutdown): outcome
   * `cancelled`, unless the target's final status had arrived, which stays the answer (the body
   * cut short). The run's `timeoutMs` aborts it too and is reported as outcome `timeout`.
   *
   * Uses undici's handler interface (`dispatch`) rather than `request()`: no body stream, no
   * promise chain and no signal plumbing per call, which is about a third of the CPU per call and
   * what bounds a herd of simultaneous runs.
   */
  execute(run: HttpCall, cancel: AbortSignal): Promise<CallReport> {
    const started = performance.now();
    let call: PreparedCall;
    try {
      call = this.prepare(run);
    } catch (err) {
      // A URL or method refused before any connection: the same run will be refused every time.
      return Promise.resolve({
        ...failedReport(describe(toError(err)), performance.now() - started),
        retryable: false,
      });
    }
    if (cancel.aborted) {
      return Promise.resolve(cancelledReport(toError(cancel.reason), performance.now() - started));
    }
    return new Promise<CallReport>((resolve) => {
      const handler = new ExcerptHandler(this.maxExcerptBytes, (ending) => {
        clearTimeout(timer);
        cancel.removeEventListener('abort', onCancel);
        resolve(this.report(ending, run, cancel, started));
      });
      const timer = setTimeout(() => handler.stop(new CallTimeoutError(run.timeoutMs)), run.timeoutMs);
      const onCancel = () => handler.stop(toError(cancel.reason));
      cancel.addEventListener('abort', onCancel, { once: true });
      try {
        this.agent.dispatch(
          {
            origin: call.origin,
            path: call.path,
            method: call.method,
            headers: call.headers,
            body: call.body,
          },
          handler,
        );
      } catch (err) {
        handler.onResponseError(undefined, toError(err));
      }
    });
  }

  /** True when undici refused the request itself (a header or method it cannot send). */
  private static invalidRequest(error: Error): boolean {
    return (
      error instanceof undiciErrors.InvalidArgumentError || error instanceof undiciErrors.NotSupportedError
    );
  }

  /** Closes pooled connections; calls still in flight are destroyed. */
  async close(): Promise<void> {
    await this.agent.destroy();
  }

  private report(ending: CallEnding, run: HttpCall, cancel: AbortSignal, started: number): CallReport {
    const durationMs = performance.now() - started;
    if (ending.error === undefined) {
      const { statusCode, cut } = ending;
      const ok = statusCode >= 200 && statusCode < 300;
      const note = cut ? `the response body was cut: ${describe(cut)}` : null;
      return {
        outcome: ok ? 'succeeded' : 'failed',
        statusCode,
        durationMs,
        error: ok ? note : note ? `HTTP ${statusCode}; ${note}` : `HTTP ${statusCode}`,
        responseExcerpt: ending.excerpt,
      };
    }
    if (ending.error instanceof CallTimeoutError) {
      return {
        outcome: 'timeout',
        statusCode: null,
        durationMs,
        error: `timed out after ${run.timeoutMs} ms`,
        responseExcerpt: null,
      };
    }
    if (cancel.aborted) return cancelledReport(toError(cancel.reason), durationMs);
    const denied = [ending.error, ending.error.cause].find((e) => e instanceof TargetDeniedError);
    // A refused address, or a request undici will never send: every attempt would end the same.
    if (denied?.permanent || HttpExecutor.invalidRequest(ending.error)) {
      return { ...failedReport(describe(ending.error), durationMs), retryable: false };
    }
    return failedReport(describe(ending.error), durationMs);
  }

  private prepare(run: HttpCall): PreparedCall {
    const target = run.target;
    if (typeof target?.url !== 'string') throw new Error('target.url is missing');
    // IP literals never reach the guarded lookup; check them (and the URL's shape) here. The
    // verdict depends only on the URL text and the policy, so it is cached with the parse until
    // the cluster's endpoints change.
    const generation = this.policy.cluster?.generation ?? 0;
    if (generation !== this.checkedGeneration) {
      this.checkedUrls.clear();
      this.checkedGeneration = generation;
    }
    let parsed = this.checkedUrls.get(target.url);
    if (parsed === undefined) {
      const problem = checkTargetUrl(target.url, this.policy);
      if (problem) {
        parsed = { problem };
      } else {
        const url = new URL(target.url);
        parsed = { origin: url.origin, path: `${url.pathname}${url.search}` };
      }
      if (this.checkedUrls.size >= 10_000) this.checkedUrls.clear();
      this.checkedUrls.set(target.url, parsed);
    }
    if ('problem' in parsed) throw new Error(`target.url ${parsed.problem}`);
    const hasBody = target.body !== undefined && target.body !== null;
    const method = (target.method ?? (hasBody ? 'POST' : 'GET')).toUpperCase();
    if (!METHODS.has(method)) throw new Error(`target.method ${method} is not supported`);
    const headers: Record<string, string> = {};
    for (const [name, value] of Object.entries(target.headers ?? {})) {
      // Jobs saved before the API checked headers may still carry one HTTP cannot send.
      const problem = headerProblem(name, String(value));
      if (problem) throw new Error(`target.headers.${name} ${problem}`);
      headers[name.toLowerCase()] = String(value);
    }
    if (hasBody) headers['content-type'] ??= 'application/json';
    // Ours last: a job cannot forge the identity of the call.
    headers['idempotency-key'] = run.id;
    headers['x-helios-job-id'] = run.jobId;
    headers['x-helios-run-id'] = run.id;
    headers['x-helios-scheduled-for'] = run.scheduledFor.toISOString();
    headers['x-helios-attempt'] = String(run.attempt);
    return {
      origin: parsed.origin,
      path: parsed.path,
      method: method as Method,
      headers,
      body: hasBody ? JSON.stringify(target.body) : undefined,
    };
  }
}

/** What a call's report says: one of the outcomes a call can have. */
export interface CallReport extends AttemptReport {
  readonly outcome: CallOutcome;
}

interface PreparedCall {
  readonly origin: string;
  readonly path: string;
  readonly method: Method;
  readonly headers: Record<string, string>;
  readonly body: string | undefined;
}

/**
 * How a call ended: a response (status and excerpt; `cut`: the connection failed, or a cancel
 * stopped the call, while its body was read), or an error or a cancel before its status arrived,
 * or the run's timeout.
 */
type CallEnding =
  | {
      readonly error?: undefined;
      readonly statusCode: number;
      readonly excerpt: string | null;
      readonly cut?: Error;
    }
  | { readonly error: Error };

/** The abort reason of a call that ran past the run's timeoutMs. */
class CallTimeoutError extends Error {
  override name = 'CallTimeoutError';
  constructor(timeoutMs: number) {
    super(`timed out after ${timeoutMs} ms`);
  }
}

/** Ends a call on purpose once the excerpt is complete: the rest of the body is never read. */
class ExcerptCompleteError extends Error {
  override name = 'ExcerptCompleteError';
}

/**
 * Bytes of a response body read past the excerpt and thrown away, so that the connection can be
 * reused; a longer body ends the call (and closes its connection) instead of being drained.
 */
const MAX_DISCARDED_BYTES = 64 * 1024;

/**
 * Receives one response through undici's handler interface (the controller-based one of undici 7
 * and later), keeping at most `maxBytes` of its body. The rest is read and discarded up to
 * MAX_DISCARDED_BYTES, then the call is aborted, which closes the connection instead of draining an
 * endless or huge body. `stop` aborts the call at any point, even before it is connected.
 */
class ExcerptHandler implements Dispatcher.DispatchHandler {
  private statusCode = 0;
  private readonly chunks: Buffer[] = [];
  private size = 0;
  private discarded = 0;
  private controller: Dispatcher.DispatchController | undefined;
  private stopReason: Error | undefined;
  private ended = false;

  constructor(
    private readonly maxBytes: number,
    private readonly onEnd: (ending: CallEnding) => void,
  ) {}

  stop(reason: Error): void {
    if (this.ended) return;
    this.stopReason ??= reason;
    if (this.controller) this.controller.abort(reason);
    // Still resolving or connecting: no byte of the request was written, and the late
    // onRequestStart aborts it before any is. End the call now, not at undici's connect timeout.
    else this.end({ error: reason });
  }

  // undici calls this once the request is about to be written to a connection; a stop before
  // that is applied here.
  onRequestStart(controller: Dispatcher.DispatchController): void {
    this.controller = controller;
    if (this.stopReason) controller.abort(this.stopReason);
  }

  onResponseStart(_controller: Dispatcher.DispatchController, statusCode: number): void {
    // undici passes informational responses (102, 103) here too: only a final status answers.
    if (statusCode >= 200) this.statusCode = statusCode;
  }

  onResponseData(_controller: Dispatcher.DispatchController, chunk: Buffer): void {
    const room = this.maxBytes - this.size;
    const kept = room <= 0 ? 0 : Math.min(room, chunk.length);
    if (kept > 0) {
      this.chunks.push(kept === chunk.length ? chunk : chunk.subarray(0, kept));
      this.size += kept;
    }
    this.discarded += chunk.length - kept;
    if (this.discarded > MAX_DISCARDED_BYTES) this.stop(new ExcerptCompleteError());
  }

  onResponseEnd(): void {
    this.end({ statusCode: this.statusCode, excerpt: this.excerpt() });
  }

  onResponseError(_controller: Dispatcher.DispatchController | undefined, err: Error): void {
    if (this.stopReason instanceof ExcerptCompleteError) {
      this.end({ statusCode: this.statusCode, excerpt: this.excerpt() });
    } else if (this.statusCode !== 0 && !(this.stopReason instanceof CallTimeoutError)) {
      // The target answered (its status arrived), then the connection failed or the call was
      // cancelled (a draining worker, a lost claim) while the body was read: the status is its
      // answer. Handing back or retrying a 2xx would make the call a second time. The run's own
      // timeout still ends it as a timeout: the whole response had to arrive within it.
      this.end({ statusCode: this.statusCode, excerpt: this.excerpt(), cut: this.stopReason ?? err });
    } else {
      this.end({ error: this.stopReason ?? err });
    }
  }

  private end(ending: CallEnding): void {
    if (this.ended) return;
    this.ended = true;
    this.onEnd(ending);
  }

  private excerpt(): string | null {
    if (this.size === 0) return null;
    return Buffer.concat(this.chunks, this.size).toString('utf8');
  }
}

function failedReport(error: string, durationMs: number): CallReport {
  return { outcome: 'failed', statusCode: null, durationMs, error, responseExcerpt: null };
}

function cancelledReport(reason: Error, durationMs: number): CallReport {
  return {
    outcome: 'cancelled',
    statusCode: null,
    durationMs,
    error: describe(reason),
    responseExcerpt: null,
  };
}

/** An error message with its cause (undici puts the socket error there). */
function describe(error: Error): string {
  const cause = error.cause instanceof Error ? `: ${error.cause.message}` : '';
  return `${error.name}: ${error.message}${cause}`;
}
