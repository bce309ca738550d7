import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { nowMs } from './stats.js';

/**
 * The job target of the Helios benchmarks: node:http on 127.0.0.1 (port 0) that answers 200 at
 * once and records, per request, only its arrival time and its `X-Helios-Scheduled-For` (two
 * numbers, so 300,000 requests cost a few MB, unlike test/support's full-request recorder).
 */
export class RecordingTarget {
  /** Arrival, ms since the epoch (sub-ms precision): when the request's headers were parsed. */
  readonly arrivals: number[] = [];
  /** X-Helios-Scheduled-For of the same request, ms since the epoch. */
  readonly scheduled: number[] = [];
  readonly runIds = new Set<string>();
  duplicates = 0;
  private readonly server: Server;

  constructor() {
    this.server = createServer((req, res) => {
      this.arrivals.push(nowMs());
      this.scheduled.push(Date.parse(String(req.headers['x-helios-scheduled-for'])));
      const runId = String(req.headers['x-helios-run-id']);
      if (this.runIds.has(runId)) this.duplicates++;
      else this.runIds.add(runId);
      req.resume();
      res.writeHead(200, { 'content-type': 'text/plain' }).end('ok');
    });
    this.server.keepAliveTimeout = 60_000;
  }

  async start(): Promise<string> {
    await new Promise<void>((resolve) => this.server.listen(0, '127.0.0.1', resolve));
    return this.url;
  }

  get url(): string {
    return `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }

  get count(): number {
    return this.arrivals.length;
  }

  /** Lateness (arrival − scheduled) of the requests scheduled in [from, to). */
  lateness(from: number, to: number): number[] {
    const out: number[] = [];
    for (let i = 0; i < this.arrivals.length; i++) {
      const at = this.scheduled[i]!;
      if (at >= from && at < to) out.push(this.arrivals[i]! - at);
    }
    return out;
  }

  reset(): void {
    this.arrivals.length = 0;
    this.scheduled.length = 0;
    this.runIds.clear();
    this.duplicates = 0;
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}
