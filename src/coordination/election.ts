import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { EtcdLeaseInvalidError, type Etcd3, type Lease, type Watcher } from 'etcd3';
import type { Logger } from '../observability/logger.js';
import { LifecycleError, toError, withTimeout } from '../errors.js';
import { LeaseExpiryWatch, type LeaseVerdict } from './lease-expiry.js';

/** One epoch of leadership, handed to the parts that only the leader runs. */
export interface Leadership {
  readonly nodeId: string;
  /** The leader key's create_revision: the fencing token of this epoch; it only grows. */
  readonly token: bigint;
  /**
   * The etcd cluster and leader key the token is a revision of (leaderKeyOf), kept with the fence;
   * absent (a test's leadership): the fence names none.
   */
  readonly leaderKey?: string;
  readonly since: Date;
  /** Aborted the moment this node stops being leader, for whatever reason. */
  readonly signal: AbortSignal;
  /** True while this node's own monotonic deadline has not passed. Check before each leader write. */
  isValid(): boolean;
}

/** Who leads, as etcd says. */
export interface LeaderRecord {
  readonly nodeId: string;
  readonly token: bigint;
  readonly since: string;
}

export type StepDownReason =
  | 'deadline'
  | 'keepalive-failed'
  | 'lease-lost'
  | 'key-lost'
  | 'fenced'
  | 'database-unreachable'
  | 'shutdown';

export interface LeaderElectionOptions {
  readonly client: Etcd3;
  /** The leader key, e.g. `/helios/leader`. */
  readonly key: string;
  readonly nodeId: string;
  /** Lease TTL; etcd leases are whole seconds, so this is rounded up. */
  readonly ttlMs: number;
  /** The leader stops this long before the lease could expire at etcd. */
  readonly safetyMarginMs: number;
  readonly logger: Logger;
  /** Called when this node becomes leader; the leader's parts are started from here. */
  readonly onElected: (leadership: Leadership) => void;
  /** Called once per epoch when leadership ends (after the epoch's signal was aborted). */
  readonly onDemoted?: (leadership: Leadership, reason: StepDownReason) => void;
}

type State = 'idle' | 'running' | 'stopping' | 'stopped';

/** Pause before trying a failed keep-alive again (and the time kept in hand before the deadline). */
const KEEPALIVE_RETRY_MS = 100;

/** This node's epoch of leadership, as the election keeps it. */
interface Epoch {
  leadership: Leadership;
  controller: AbortController;
  lease: Lease;
  deadline: number;
  timer?: NodeJS.Timeout;
  /** The last keep-alive failed: the next is tried at once, not after the usual pause. */
  retrying?: boolean;
}

/**
 * Campaigns for one etcd key with `create_revision == 0 → put(key, lease)` and, while leader,
 * keeps the lease alive itself (not with the client's automatic keep-alive, which reports a lost
 * lease only ~2×TTL after etcd became unreachable). Leadership ends at once when the monotonic
 * deadline passes, when etcd says the lease is gone or the key is no longer the one it created
 * (checkKey), or on `stepDown()`; a failed keep-alive is tried again until the deadline (see
 * keepAlive).
 *
 * The deadline is measured from when a keep-alive was *sent*: etcd can only have renewed the
 * lease after that instant, so `sentAt + TTL` is never later than the real expiry at etcd, and
 * `− safetyMargin` absorbs clock-rate drift and the time a final write needs to reach PostgreSQL.
 */
export class LeaderElection {
  private state: State = 'idle';
  private readonly abort = new AbortController();
  private loop: Promise<void> = Promise.resolve();
  private stopping?: Promise<void>;
  private epoch?: Epoch;
  private wake?: () => void;
  private readonly ttlSeconds: number;

  constructor(private readonly options: LeaderElectionOptions) {
    this.ttlSeconds = Math.ceil(options.ttlMs / 1000);
  }

  /** The current epoch if this node leads and its deadline has not passed. */
  current(): Leadership | null {
    const epoch = this.epoch;
    return epoch && epoch.leadership.isValid() ? epoch.leadership : null;
  }

  /** Begins campaigning in the background. */
  start(): void {
    if (this.state !== 'idle') throw new LifecycleError(`election is ${this.state}`);
    this.state = 'running';
    this.loop = this.campaignLoop();
  }

  /**
   * Ends the current epoch (if any) and campaigns again after `pauseMs`: used when the fence
   * rejected a write, which proves a newer leader exists.
   *
   * `of` names the epoch the caller belongs to; when it is not the current one, nothing happens.
   * A task of an ended epoch can still be finishing a write (it passed its leadership check just
   * before the epoch ended) when this node has already won the next epoch; that write is fenced
   * out by the new epoch's token, and its "step down" must not end the new epoch.
   */
  stepDown(reason: StepDownReason, pauseMs = 0, of?: Leadership): void {
    const epoch = this.epoch;
    if (!epoch) return;
    if (of && epoch.leadership !== of) {
      this.options.logger.debug(
        { token: of.token.toString(), current: epoch.leadership.token.toString(), reason },
        'step-down request of an ended epoch ignored',
      );
      return;
    }
    this.endEpoch(reason);
    void this.release(epoch.lease);
    if (pauseMs > 0) this.pauseUntil = performance.now() + pauseMs;
  }
  private pauseUntil = 0;

  /** Steps down (deleting the key so another node takes over at once) and stops campaigning. */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      this.state = 'stopping';
      this.abort.abort();
      this.wake?.();
      const epoch = this.epoch;
      if (epoch) {
        this.endEpoch('shutdown');
        await this.release(epoch.lease);
      }
      await this.loop;
      const watcher = await this.watcher;
      await watcher?.cancel().catch(() => undefined);
      this.state = 'stopped';
    })();
    return this.stopping;
  }

  private async campaignLoop(): Promise<void> {
    const { logger } = this.options;
    const signal = this.abort.signal;
    const keepAliveEveryMs = Math.max(200, Math.floor((this.ttlSeconds * 1000) / 3));
    while (!signal.aborted) {
      try {
        const wait = this.pauseUntil - performance.now();
        if (wait > 0) await sleep(wait, undefined, { signal });
        if (this.epoch) {
          await this.keepAlive(keepAliveEveryMs);
        } else if (!(await this.tryAcquire())) {
          await this.standBy(keepAliveEveryMs);
        }
      } catch (err) {
        if (signal.aborted) break;
        logger.warn({ err: toError(err) }, 'election step failed; retrying');
        await sleep(Math.min(500, keepAliveEveryMs), undefined, { signal }).catch(() => undefined);
      }
    }
  }

  /** One campaign attempt: grant a lease, then the create-if-absent transaction. */
  private async tryAcquire(): Promise<boolean> {
    const { client, key, nodeId, logger } = this.options;
    this.readAgain = false;
    const read = await client.get(key).exec();
    this.readRevision = read.header.revision;
    const holder = read.kvs[0];
    if (holder) {
      if (this.holder?.leaseId !== holder.lease) {
        this.holder = holder.lease === '0' ? undefined : new LeaseExpiryWatch(holder.lease);
        this.holderCheckAt = 0;
      }
      return false;
    }
    this.holder = undefined;

    const lease = client.lease(this.ttlSeconds, { autoKeepAlive: false });
    lease.on('lost', () => undefined); // loss is detected by our own keep-alives and deadline
    const sentAt = performance.now();
    const leaseId = await withTimeout(lease.grant(), 2000, 'etcd lease grant');
    const since = new Date();
    const value = JSON.stringify({ nodeId, since: since.toISOString() });
    const result = await withTimeout(
      client.if(key, 'Create', '==', 0).then(client.put(key).value(value).lease(leaseId)).commit(),
      2000,
      'etcd campaign txn',
    );
    if (!result.succeeded) {
      void this.release(lease);
      return false;
    }
    // The txn's revision is the revision at which our put created the key: its create_revision.
    const token = BigInt(result.header.revision);
    const controller = new AbortController();
    const epoch: Epoch = {
      controller,
      lease,
      deadline: sentAt + this.ttlSeconds * 1000 - this.options.safetyMarginMs,
      leadership: {
        nodeId,
        token,
        leaderKey: leaderKeyOf(result.header.cluster_id, this.options.key),
        since,
        signal: controller.signal,
        isValid: () => !controller.signal.aborted && performance.now() < epoch.deadline,
      },
    };
    this.epoch = epoch;
    this.armDeadline();
    logger.info({ token: token.toString() }, 'became leader');
    try {
      this.options.onElected(epoch.leadership);
    } catch (err) {
      logger.error({ err: toError(err) }, 'starting the leader parts failed; stepping down');
      this.stepDown('shutdown', 1000);
    }
    return true;
  }

  /**
   * Renews the lease every third of the TTL. A lease etcd reports gone ends the epoch at once; a
   * keep-alive that fails (a member down or cut off, a timeout) is tried again at once, on another
   * member (the client passes over a member that just failed), for as long as the epoch's own
   * deadline has not passed: the deadline, counted from the last renewal that succeeded, is what
   * keeps two leaders apart, not the failed call. Ending the epoch at the first failure made one
   * partitioned etcd follower depose the leader again and again.
   */
  private async keepAlive(everyMs: number): Promise<void> {
    const epoch = this.epoch;
    if (!epoch) return;
    const pauseMs = epoch.retrying ? KEEPALIVE_RETRY_MS : everyMs;
    await sleep(pauseMs, undefined, { signal: epoch.controller.signal }).catch(() => undefined);
    if (this.epoch !== epoch || epoch.controller.signal.aborted) return;
    const sentAt = performance.now();
    // A try must end before the deadline, so that a failure still leaves time to step down cleanly.
    const tryMs = Math.max(100, Math.min(everyMs, epoch.deadline - sentAt - KEEPALIVE_RETRY_MS));
    try {
      await withTimeout(
        epoch.lease.keepaliveOnce({ deadline: Date.now() + tryMs }),
        tryMs,
        'etcd keep-alive',
      );
      if (this.epoch !== epoch) return;
      epoch.deadline = sentAt + this.ttlSeconds * 1000 - this.options.safetyMarginMs;
      epoch.retrying = false;
      this.armDeadline();
      void this.checkKey(epoch);
    } catch (err) {
      if (this.epoch !== epoch) return;
      if (err instanceof EtcdLeaseInvalidError) {
        // etcd3 throws this for an answer of TTL 0 (it never resolves with one): the lease was
        // revoked (by a standby that proved it expired) or expired. Retrying until the deadline
        // would lead without a lease.
        this.options.logger.warn('etcd says our leader lease is gone');
        this.endEpoch('lease-lost');
        return;
      }
      if (performance.now() + KEEPALIVE_RETRY_MS < epoch.deadline) {
        this.options.logger.warn(
          { err: toError(err), leftMs: Math.round(epoch.deadline - performance.now()) },
          'leader keep-alive failed; trying again before the deadline',
        );
        epoch.retrying = true;
        return;
      }
      this.options.logger.warn({ err: toError(err) }, 'leader keep-alive failed; stepping down');
      this.endEpoch('keepalive-failed');
      void this.release(epoch.lease);
    }
  }

  /**
   * Ends the epoch when the leader key is no longer the one it created: an operator deleted it
   * (`etcdctl del`, or the whole HELIOS_ETCD_PREFIX) and left the lease alive, so keep-alives still
   * succeed. Unchecked, a standby took the key at once and two nodes led until the old one's next
   * write met the fence (never, for a leader with nothing to write); a lone leader led without a key
   * for good: no leader in the cluster view, and its epoch ended by etcd's reading (EndedEpochs), so
   * the workers dropped its late runs as misfires. Checked after each renewal, off its path: a slow
   * read must not delay the next keep-alive, and a read that fails proves nothing.
   */
  private async checkKey(epoch: Epoch): Promise<void> {
    try {
      const read = await withTimeout(this.options.client.get(this.options.key).exec(), 1000, 'etcd get');
      const keyToken = read.kvs[0]?.create_revision ?? null;
      if (this.epoch !== epoch || keyToken === epoch.leadership.token.toString()) return;
      this.options.logger.warn({ keyToken }, 'our leader key was deleted in etcd; stepping down');
      this.endEpoch('key-lost');
      void this.release(epoch.lease);
    } catch (err) {
      this.options.logger.debug({ err: toError(err) }, 'reading our leader key failed');
    }
  }

  private armDeadline(): void {
    const epoch = this.epoch;
    if (!epoch) return;
    clearTimeout(epoch.timer);
    epoch.timer = setTimeout(
      () => {
        if (this.epoch !== epoch) return;
        // Re-check: the timer can fire late (a paused process) or early relative to a renewal.
        if (performance.now() < epoch.deadline) return this.armDeadline();
        this.options.logger.warn('leader deadline passed without a keep-alive; stepping down');
        this.endEpoch('deadline');
        void this.release(epoch.lease);
      },
      Math.max(0, epoch.deadline - performance.now()),
    );
    epoch.timer.unref();
  }

  private endEpoch(reason: StepDownReason): void {
    const epoch = this.epoch;
    if (!epoch) return;
    this.epoch = undefined;
    clearTimeout(epoch.timer);
    epoch.controller.abort(reason);
    this.options.logger.info({ token: epoch.leadership.token.toString(), reason }, 'stepped down');
    try {
      this.options.onDemoted?.(epoch.leadership, reason);
    } catch (err) {
      this.options.logger.error({ err: toError(err) }, 'onDemoted failed');
    }
    this.wake?.();
  }

  /** Revokes a lease (deleting the leader key if it still holds it), best effort. */
  private async release(lease: Lease): Promise<void> {
    try {
      await withTimeout(lease.revoke(), 1500, 'etcd lease revoke');
    } catch (err) {
      this.options.logger.debug({ err: toError(err) }, 'lease revoke failed; it will expire');
    }
  }

  /**
   * Standing by while another node leads: returns when the leader key is deleted (watch), when
   * `pollMs` passes (the caller reads the key again), or as soon as the holder's lease is seen
   * expired and this node has revoked it, which is up to 500 ms sooner than etcd would.
   */
  private async standBy(pollMs: number): Promise<void> {
    const holder = this.holder;
    const until = performance.now() + pollMs;
    if (!this.watcher) this.watchLeaderKey(); // before the first look, which the deletion must wake
    for (;;) {
      const now = performance.now();
      const leftMs = until - now;
      if (leftMs <= 0 || this.abort.signal.aborted) return;
      if (!holder) return void (await this.waitForVacancy(leftMs));
      if (this.holderCheckAt > now) {
        if (await this.waitForVacancy(Math.min(this.holderCheckAt - now, leftMs))) return;
        continue;
      }
      const verdict = await this.checkHolderLease(holder);
      if (verdict === 'gone' || verdict === 'woken') return;
      if (verdict === 'expired') return this.revokeExpired(holder);
    }
  }
  /** The lease of the node that leads now, watched while standing by, and when to look again. */
  private holder?: LeaseExpiryWatch;
  private holderCheckAt = 0;

  /** One look at the holder's lease; 'woken' when the key's deletion or stop() came first. */
  private async checkHolderLease(holder: LeaseExpiryWatch): Promise<LeaseVerdict | 'woken'> {
    if (this.readAgain || this.abort.signal.aborted) return 'woken';
    const askedAt = performance.now();
    const woken = new Promise<'woken'>((resolve) => (this.wake = () => resolve('woken')));
    try {
      const answer = await Promise.race([
        withTimeout(
          this.options.client.leaseClient.leaseTimeToLive({ ID: holder.leaseId }),
          1000,
          'etcd lease time-to-live',
        ),
        woken,
      ]);
      if (answer === 'woken') return answer;
      const { TTL, grantedTTL, header } = answer;
      const verdict = holder.observe(
        Number(TTL),
        Number(grantedTTL),
        askedAt,
        performance.now(),
        header.raft_term,
      );
      this.holderCheckAt = performance.now() + holder.checkInMs;
      return verdict;
    } catch (err) {
      // Nothing is concluded from a failed look; the next answer starts over if it comes late.
      this.options.logger.debug({ err: toError(err) }, 'reading the leader lease failed');
      this.holderCheckAt = performance.now() + 1000;
      return 'live';
    } finally {
      this.wake = undefined;
    }
  }

  private async revokeExpired(holder: LeaseExpiryWatch): Promise<void> {
    this.holder = undefined;
    try {
      // A quorum read in the term the answers came from proves they came from etcd's real leader
      // (see LeaseExpiryWatch); the key still bound to the lease proves the holder did not change.
      const read = await withTimeout(this.options.client.get(this.options.key).exec(), 1000, 'etcd get');
      if (read.header.raft_term !== holder.term || read.kvs[0]?.lease !== holder.leaseId) return;
      this.options.logger.info({ lease: holder.leaseId }, 'the leader lease expired; revoking it');
      await withTimeout(
        this.options.client.leaseClient.leaseRevoke({ ID: holder.leaseId }),
        1500,
        'etcd lease revoke',
      );
    } catch (err) {
      // Already revoked by etcd or another standby, or etcd is unreachable: campaigning tells.
      this.options.logger.debug({ err: toError(err) }, 'revoking the expired leader lease failed');
    }
  }

  /**
   * Waits until the leader key is deleted (watch) or `pollMs` passes, whichever is first; true
   * when woken before the time was up.
   */
  private async waitForVacancy(pollMs: number): Promise<boolean> {
    if (!this.watcher) this.watchLeaderKey();
    if (this.readAgain) return true;
    const woken = await new Promise<boolean>((resolve) => {
      const timer = setTimeout(() => resolve(false), pollMs);
      this.wake = () => {
        clearTimeout(timer);
        resolve(true);
      };
      if (this.abort.signal.aborted) this.wake();
    });
    this.wake = undefined;
    return woken;
  }

  /**
   * One watcher while etcd keeps it; polling covers the moments it is reconnecting. A watcher etcd
   * cancels is dropped by the client for good, and that is what a compaction does to it: a broken
   * stream (a member restarted, a network blip) resumes from the last revision the watcher saw,
   * which etcd moves on only at a change of the key or a progress notice (every 10 min), while
   * compaction runs every 5 min under Kubernetes. The changes in between are gone (ErrCompacted),
   * so the key is read again (it may have been deleted meanwhile) and watched anew from that read.
   * Unwatched, a standby learnt of a graceful handover only at its next poll, up to a second later.
   */
  private watchLeaderKey(): void {
    const watching: Promise<Watcher | undefined> = this.options.client
      .watch()
      .key(this.options.key)
      // From just after the last read: a deletion that lands before etcd has registered the watch
      // (≈14 ms) is delivered too, instead of being noticed at the next read, ≈1 s later.
      .startRevision((BigInt(this.readRevision) + 1n).toString())
      .create()
      .then((watcher) => {
        watcher.on('delete', () => {
          // Remembered: it can land while this node is not waiting (reading the key or a lease).
          this.readAgain = true;
          this.wake?.();
        });
        watcher.on('error', (err) => {
          this.options.logger.info(
            { err: toError(err) },
            'etcd cancelled the leader key watch; reading the key again',
          );
          if (this.watcher === watching) this.watcher = undefined;
          this.readAgain = true;
          this.wake?.();
        });
        if (this.abort.signal.aborted) void watcher.cancel();
        return watcher;
      })
      .catch((err: unknown) => {
        if (this.watcher === watching) this.watcher = undefined;
        this.options.logger.debug({ err: toError(err) }, 'leader key watch failed; polling');
        return undefined;
      });
    this.watcher = watching;
  }
  private watcher?: Promise<Watcher | undefined>;
  /**
   * The key may have changed since the last read (the watch saw it deleted, or was cancelled):
   * read it again before waiting.
   */
  private readAgain = false;
  /** The etcd revision of the latest read of the leader key. */
  private readRevision = '0';
}

/** Reads who leads from etcd (for the cluster view); null when nobody does. */
export async function readLeader(client: Etcd3, key: string): Promise<LeaderRecord | null> {
  const response = await client.get(key).exec();
  const kv = response.kvs[0];
  if (!kv) return null;
  const value = JSON.parse(kv.value.toString()) as { nodeId: string; since: string };
  return { nodeId: value.nodeId, since: value.since, token: BigInt(kv.create_revision) };
}

/**
 * Names one leader key of one etcd cluster ("<cluster id>/<key>"): tokens (create_revisions) of
 * the same name compare; those of another etcd or prefix do not (see EndedEpochs).
 */
export function leaderKeyOf(clusterId: string, key: string): string {
  return `${clusterId}/${key}`;
}
