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
}

/**
 * Coalesces calls into batches of at most `maxBatch`, with at most `maxInFlight` batches running
 * at once. A call made while nothing runs is sent after the current turn of the event loop (every
 * run whose hold timer expired in this turn joins it); calls made while `maxInFlight` batches run
 * wait for one of them to finish and then go together. So batches stay small when the load is light
 * and grow with it (group commit): a herd of runs due at once costs a few large statements
 * instead of one small statement per freed execution slot, and the per-statement overhead, not
 * the rows, was what PostgreSQL spent its time on.
 */
export class MicroBatcher<I, O> {
  private pending: Pending<I, O>[] = [];
  private scheduled = false;
  private inFlight = 0;

  constructor(
    private readonly run: BatchFunction<I, O>,
    private readonly maxBatch: number,
    private readonly maxInFlight = Number.POSITIVE_INFINITY,
  ) {}

  /** Adds an item to the next batch; resolves with its result. */
  add(item: I): Promise<O> {
    return new Promise<O>((resolve, reject) => {
      this.pending.push({ item, resolve, reject });
      this.schedule();
    });
  }

  private schedule(): void {
    if (this.scheduled || this.pending.length === 0 || this.inFlight >= this.maxInFlight) return;
    this.scheduled = true;
    // setImmediate runs after the timers and I/O callbacks of this turn.
    setImmediate(() => this.flush());
  }

  private flush(): void {
    this.scheduled = false;
    while (this.pending.length > 0 && this.inFlight < this.maxInFlight) {
      const batch = this.pending.splice(0, this.maxBatch);
      this.inFlight += 1;
      void this.runBatch(batch).finally(() => {
        this.inFlight -= 1;
        this.schedule();
      });
    }
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
