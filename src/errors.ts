/** Normalises anything thrown into an Error, once, at the boundary where it is caught. */
export function toError(value: unknown): Error {
  if (value instanceof Error) return value;
  return new Error(typeof value === 'string' ? value : JSON.stringify(value));
}

/** A leader write was attempted by a node that does not (or no longer) hold leadership. */
export class NotLeaderError extends Error {
  override name = 'NotLeaderError';
}

/** The leader_fence holds a newer token than ours: a newer leader exists, this one must step down. */
export class StaleFencingTokenError extends Error {
  override name = 'StaleFencingTokenError';
  constructor(
    readonly token: bigint,
    options?: ErrorOptions,
  ) {
    super(`fencing token ${token} is stale: a newer leader has written`, options);
  }
}

/** A worker's claim on a run was lost (expired and re-queued, or taken by another attempt). */
export class ClaimLostError extends Error {
  override name = 'ClaimLostError';
  /**
   * @param outcomeWanted false when the run was deleted (its job's delete) or replaced (a `replace`
   * run asked for later started): no one calls it again and its outcome is wanted by no one. True
   * (the default) when its claim expired and the run went back to the queue or to another attempt.
   */
  constructor(
    message: string,
    readonly outcomeWanted = true,
  ) {
    super(message);
  }
}

/** A call to one of our servers did not answer within our own deadline. */
export class TimeoutError extends Error {
  override name = 'TimeoutError';
}

/** A lifecycle method was called in a state that does not allow it. */
export class LifecycleError extends Error {
  override name = 'LifecycleError';
}

/** Races a promise against a deadline; the library call itself is not cancelled. */
export async function withTimeout<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new TimeoutError(`${what} timed out after ${ms} ms`)), ms);
    timer.unref();
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}
