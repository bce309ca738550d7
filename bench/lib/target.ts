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
  /**
   * Calls and repeated run ids per X-Helios-Scheduled-For (ms), so that two herds on one target
   * (a cold one, then a warm one) are told apart without reset(), which would forget the run ids
   * and hide a run called in both.
   */
  private readonly perInstant = new Map<number, { calls: number; duplicates: number }>();
  private readonly server: Server;

  constructor() {
    this.server = createServer((req, res) => {
      this.arrivals.push(nowMs());
      const scheduledFor = Date.parse(String(req.headers['x-helios-scheduled-for']));
      this.scheduled.push(scheduledFor);
      let instant = this.perInstant.get(scheduledFor);
      if (!instant) this.perInstant.set(scheduledFor, (instant = { calls: 0, duplicates: 0 }));
      instant.calls++;
      const runId = String(req.headers['x-helios-run-id']);
      if (this.runIds.has(runId)) {
        this.duplicates++;
        instant.duplicates++;
      } else this.runIds.add(runId);
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

  /** Calls scheduled for `at` (ms since the epoch) that arrived, repeats included. */
  callsFor(at: number): number {
    return this.perInstant.get(at)?.calls ?? 0;
  }

  /** Of those, calls whose run id had arrived before (in any round): a run called twice. */
  duplicatesFor(at: number): number {
    return this.perInstant.get(at)?.duplicates ?? 0;
  }

  /** Distinct runs scheduled for `at` that called: calls less repeats. */
  runsCalledFor(at: number): number {
    return this.callsFor(at) - this.duplicatesFor(at);
  }

  /** Arrival times of the calls scheduled for `at`. */
  arrivalsFor(at: number): number[] {
    return this.arrivals.filter((_, i) => this.scheduled[i] === at);
  }

  reset(): void {
    this.arrivals.length = 0;
    this.scheduled.length = 0;
    this.runIds.clear();
    this.duplicates = 0;
    this.perInstant.clear();
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}
