/**
 * The REST API of the chaos cluster as a client sees it: each call goes to a live node with the
 * api role (a frozen or dead node times out, and the call is tried on another one), and reports
 * when it was sent and when it was answered, which is all the reference model may rely on.
 */
import { setTimeout as sleep } from 'node:timers/promises';

export interface ApiAnswer {
  readonly status: number;
  readonly body: unknown;
}

export interface CallRecord {
  /** When the first try was sent and the last one answered (or given up). */
  readonly sentAt: number;
  readonly answeredAt: number;
  /** The answer of the last try that got one; undefined when no try got an answer. */
  readonly answer?: ApiAnswer;
  readonly tries: number;
  /** True when some try got no answer (it may have taken effect anyway). */
  readonly lostTry: boolean;
}

export class ChaosApi {
  constructor(
    /** The API base URLs of the nodes alive now, in no particular order. */
    private readonly nodes: () => string[],
    private readonly random: () => number,
    /** Bearer token of an admin (the chaos nodes run with HELIOS_API_TOKENS). */
    private readonly token: string | undefined,
    private readonly options: { tryTimeoutMs: number; giveUpAfterMs: number } = {
      tryTimeoutMs: 2500,
      giveUpAfterMs: 9000,
    },
  ) {}

  /**
   * Calls `method path` until a node answers with anything but a 5xx, or `giveUpAfterMs` passed.
   * `retry: false` makes one try only (a call that must not be repeated, such as trigger).
   */
  async call(method: string, path: string, body?: unknown, retry = true): Promise<CallRecord> {
    const sentAt = Date.now();
    let tries = 0;
    let lostTry = false;
    let answer: ApiAnswer | undefined;
    let last: string | undefined;
    while (Date.now() - sentAt < this.options.giveUpAfterMs) {
      const nodes = this.nodes();
      const candidates = nodes.filter((n) => n !== last);
      const pool = candidates.length > 0 ? candidates : nodes;
      if (pool.length === 0) {
        await sleep(200);
        continue;
      }
      const node = pool[Math.floor(this.random() * pool.length)]!;
      last = node;
      tries += 1;
      try {
        const response = await fetch(`${node}/api/v1${path}`, {
          method,
          headers: {
            ...(body === undefined ? {} : { 'content-type': 'application/json' }),
            ...(this.token ? { authorization: `Bearer ${this.token}` } : {}),
            'x-helios-client': 'chaos',
          },
          body: body === undefined ? undefined : JSON.stringify(body),
          signal: AbortSignal.timeout(this.options.tryTimeoutMs),
        });
        const text = await response.text();
        answer = { status: response.status, body: text ? (JSON.parse(text) as unknown) : null };
        if (response.status < 500) break;
      } catch {
        lostTry = true;
        answer = undefined;
      }
      if (!retry) break;
      await sleep(200);
    }
    return { sentAt, answeredAt: Date.now(), answer, tries, lostTry };
  }
}
