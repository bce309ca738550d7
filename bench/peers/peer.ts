/**
 * What the herd benchmark needs from a peer job queue. Each peer is loaded from this folder's own
 * node_modules (bench/peers/package.json), so the root package does not depend on it.
 */
export interface PeerQueue {
  readonly name: string;
  /** One line saying which settings were used (batching, concurrency, polling / LISTEN). */
  describe(settings: PeerSettings): string;
  /** Creates the peer's schema (and queue) in an empty database. */
  prepare(url: string): Promise<void>;
  /**
   * Inserts `count` items numbered `offset`…`offset + count − 1` (offset default 0), all due at
   * `at`, in one statement. A second herd on the same workers takes the next numbers, so its
   * starts and duplicates are told apart from the first's.
   */
  enqueue(url: string, count: number, at: Date, offset?: number): Promise<void>;
  /**
   * Starts consuming in this process; the handler of item n awaits `handle(n)` (which records the
   * start and, in the HTTP variant, makes the call). Returns stop.
   */
  work(
    url: string,
    settings: PeerSettings,
    handle: (n: number) => Promise<void>,
  ): Promise<() => Promise<void>>;
}

/** Tuning of one peer run; each peer reads the fields that apply to it. */
export interface PeerSettings {
  /** Items fetched (and locked) per query. */
  readonly batch: number;
  /** Fetch loops (pg-boss: work() calls) or concurrent jobs (graphile-worker) per process. */
  readonly concurrency: number;
  /** Polling interval for jobs that become due (ms); neither peer is woken by a future run_at. */
  readonly pollMs: number;
  /** Connections per process. */
  readonly poolSize: number;
  /**
   * Keep-alive sockets to the target per process in the HTTP variant (herd-worker.ts); the best
   * settings (herd.ts) give HELIOS_WORKER_CONCURRENCY's default, the calls one Helios worker makes
   * at once.
   */
  readonly connections: number;
}

/** Payload of each item: its index, so the handler can record when item n started. */
export interface HerdItem {
  readonly n: number;
}

/** Imports a package from bench/peers/node_modules (a variable specifier keeps tsc from resolving it). */
export function importPeer<T>(specifier: string): Promise<T> {
  return import(specifier) as Promise<T>;
}
