import type { Connections } from '../store/pool-share.js';
import { ClaimLostError, toError } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { Notifications } from '../store/notifications.js';
import { findLostClaims } from '../store/runs.js';

/** A call in progress under a claim, as the watch sees it. */
export interface WatchedClaim {
  readonly runId: string;
  readonly attempt: number;
  readonly controller: AbortController;
}

/** Options of {@link watchClaims}. */
export interface ClaimWatchOptions {
  readonly pool: Connections;
  readonly nodeId: string;
  readonly notifications: Notifications;
  /** The claims currently executing on this node. */
  readonly claims: () => Iterable<WatchedClaim>;
  /** Check at least this often while calls are in flight (NOTIFY makes it sooner). */
  readonly intervalMs: number;
  readonly logger: Logger;
  readonly signal: AbortSignal;
}

/**
 * Aborts calls whose claim this node no longer holds, until `signal` aborts; never rejects.
 *
 * Why a watch rather than a per-run NOTIFY payload: one query per wake-up checks every claim of
 * the node, and the same check catches a claim that expired and was taken over (a paused worker
 * resuming), not only `replace`. A `replace` claim NOTIFYs `helios_runs`, which ends the wait at
 * once, so a replaced call is aborted within a round trip; a lost notification (LISTEN connection
 * reconnecting) only delays the abort to the next interval.
 */
export async function watchClaims(options: ClaimWatchOptions): Promise<void> {
  const { pool, nodeId, notifications, intervalMs, logger, signal } = options;
  while (!signal.aborted) {
    await notifications.wait('helios_runs', intervalMs, signal);
    if (signal.aborted) return;
    const watched = [...options.claims()];
    if (watched.length === 0) continue;
    try {
      const lost = await findLostClaims(pool, watched, nodeId);
      // By run id: a pause or delete in a herd loses thousands of claims in one check.
      const byRun = lost.length > 0 ? new Map(watched.map((w) => [w.runId, w])) : undefined;
      for (const claim of lost) {
        const entry = byRun?.get(claim.id);
        const why =
          claim.state === null ? 'deleted' : `now ${claim.state}${claim.reason ? ` (${claim.reason})` : ''}`;
        // Deleted or replaced: a user's delete or the job's policy ended the run, not a lost claim.
        const ended = claim.state === null || (claim.state === 'failed' && claim.reason === 'replaced');
        entry?.controller.abort(new ClaimLostError(`run ${claim.id} is ${why}`, !ended));
      }
    } catch (err) {
      if (!signal.aborted) logger.warn({ err: toError(err) }, 'claim check failed; retrying');
    }
  }
}
