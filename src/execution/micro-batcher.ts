import { toError } from '../errors.js';

/** One item of a batch failed on its own (the batch function returns it in that item's place). */
export class BatchItemError {
  constructor(readonly error: Error) {}
}

/** Runs one batch; returns one result (or the item's own failure) per item, in order. */
export type BatchFunction<I, O> = (items: I[]) => Promise<(O | BatchItemError)[]>;

interface Pending<I, O> {
  readonly item: I;
  readonly resolve: (value: O) => void;
  readonly reject: (error: Error) => void;
  /** Added with `mayWait` (see MicroBatcher.add). */
  readonly mayWait: boolean;
  /** performance.now() when it was added. */
  readonly since: number;
  /** Counted in `heldPending` (held back by the wait policy) while pending. */
  held: boolean;
}

/**
 * When items added with `mayWait` are held back instead of sent after the current turn: while
 * `busy()` says so, for at most `maxWaitMs` each and `maxWaiting` in all. Whoever knows when
 * `busy()` turns false calls {@link MicroBatcher.release}.
 */
export interface WaitPolicy {
  readonly busy: () => boolean;
  readonly maxWaitMs: number;
  readonly maxWaiting: number;
  /** Called when more items are held than before (the run queue: their runs' slots are free). */
  readonly onHold?: () => void;
}

/**
 * Coalesces calls into batches of at most `maxBatch`, with at most `maxInFlight` batches running
 * at once. A call made while nothing runs is sent after the current turn of the event loop (every
 * run whose hold timer expired in this turn joins it); calls made while `maxInFlight` batches run
 * wait for one of them to finish and then go together. So batches stay small when the load is light
 * and grow with it (group commit): a herd of runs due at once costs a few large statements
 * instead of one small statement per freed execution slot, and the per-statement overhead, not
 * the rows, was what PostgreSQL spent its time on.
 *
 * Items that may wait (a {@link WaitPolicy}) are held back while the policy says the process is
 * busy with more urgent work, and go together once it is not, or once the oldest has waited long
 * enough: the worker's completions wait while its calls are underway (see batching.ts).
 */
export class MicroBatcher<I, O> {
  private pending: Pending<I, O>[] = [];
  private scheduled = false;
  private inFlight = 0;
  /** Pending items added without `mayWait`: while there is one, nothing is held back. */
  private urgent = 0;
  /** Pending items held back by the wait policy (their `held` flag). */
  private heldPending = 0;
  /** Ends a hold when the oldest held item has waited `maxWaitMs`. */
  private holdTimer?: NodeJS.Timeout;

  constructor(
    private readonly run: BatchFunction<I, O>,
    private readonly maxBatch: number,
    private readonly maxInFlight = Number.POSITIVE_INFINITY,
    private readonly waitPolicy?: WaitPolicy,
  ) {}

  /**
   * Adds an item to the next batch; resolves with its result. An item that `mayWait` is held back
   * while the wait policy's `busy()` is true, for at most its `maxWaitMs` (with no policy, or an
   * urgent item pending, it goes as any other).
   */
  add(item: I, mayWait = false): Promise<O> {
    return new Promise<O>((resolve, reject) => {
      this.pending.push({ item, resolve, reject, mayWait, since: performance.now(), held: false });
      if (!mayWait) this.urgent += 1;
      this.schedule();
    });
  }

  /**
   * Items held back by the wait policy now. Once one goes (its wait is over) it is no longer
   * counted: it waits for the database as any write does (the run queue's slots then slow the
   * intake when the database is slow, as without a hold).
   */
  get held(): number {
    return this.heldPending;
  }

  /** The wait policy's `busy()` may have turned false: held items go unless it still says busy. */
  release(): void {
    if (this.heldPending > 0) this.schedule();
  }

  private schedule(): void {
    if (this.scheduled || this.pending.length === 0) return;
    const going = this.goingNow();
    if (going < this.pending.length) this.holdFrom(going);
    if (going === 0 || this.inFlight >= this.maxInFlight) return;
    this.scheduled = true;
    // setImmediate runs after the timers and I/O callbacks of this turn.
    setImmediate(() => this.flush());
  }

  /**
   * How many pending items (from the oldest) go now: all of them, unless every one may wait, fewer
   * than `maxWaiting` wait, no batch runs and the policy is busy; then those that have waited
   * `maxWaitMs`. While a batch runs nothing is held: a database slow to write must slow the
   * callers (the run queue's slots), not let held items pile up behind it, and under steady load
   * (a batch of the writes that waited their time running) the writes go as without a hold.
   */
  private goingNow(): number {
    const policy = this.waitPolicy;
    const all = this.pending.length;
    if (!policy || this.urgent > 0 || this.inFlight > 0 || all >= policy.maxWaiting || !policy.busy())
      return all;
    const now = performance.now();
    let overdue = 0;
    while (overdue < all && this.pending[overdue]!.since + policy.maxWaitMs <= now) overdue += 1;
    return overdue;
  }

  /** Counts the pending items from `index` on as held, and arms the timer that ends their wait. */
  private holdFrom(index: number): void {
    let grew = false;
    // Items are marked newest first, down to the first one marked before: no gaps behind it.
    for (let i = this.pending.length - 1; i >= index && !this.pending[i]!.held; i--) {
      this.pending[i]!.held = true;
      this.heldPending += 1;
      grew = true;
    }
    if (!this.holdTimer) {
      const endsIn = this.pending[index]!.since + this.waitPolicy!.maxWaitMs - performance.now();
      this.holdTimer = setTimeout(() => {
        this.holdTimer = undefined;
        this.release();
      }, endsIn);
      this.holdTimer.unref();
    }
    if (grew) this.waitPolicy!.onHold?.();
  }

  private flush(): void {
    this.scheduled = false;
    let going = this.goingNow();
    // What goes now is no longer held back, also while it waits for a running batch to end.
    for (let i = 0; i < going; i++) {
      const p = this.pending[i]!;
      if (!p.held) continue;
      p.held = false;
      this.heldPending -= 1;
    }
    while (going > 0 && this.inFlight < this.maxInFlight) {
      const batch = this.pending.splice(0, Math.min(going, this.maxBatch));
      going -= batch.length;
      for (const p of batch) if (!p.mayWait) this.urgent -= 1;
      this.inFlight += 1;
      void this.runBatch(batch).finally(() => {
        this.inFlight -= 1;
        this.schedule();
      });
    }
    // What stays is held (counted, its timer armed) or waits for a running batch to end.
    this.schedule();
  }

  private async runBatch(batch: Pending<I, O>[]): Promise<void> {
    try {
      const results = await this.run(batch.map((p) => p.item));
      batch.forEach((p, i) => {
        const result = results[i]!;
        if (result instanceof BatchItemError) p.reject(result.error);
        else p.resolve(result);
      });
    } catch (err) {
      const error = toError(err);
      for (const p of batch) p.reject(error);
    }
  }
}
