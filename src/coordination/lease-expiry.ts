/**
 * Tells, from etcd's TimeToLive answers, when another node's lease has certainly expired, so that
 * a standby can revoke it at once. etcd itself revokes expired leases in a loop that runs every
 * 500 ms, which added up to half a second to every failover (kill -9 of the leader: TTL + 0–0.5 s
 * before its key was deleted).
 *
 * etcd answers the time left in whole seconds, truncated: 0 means less than a second left, or
 * already expired; −1 means the lease is gone. A renewal puts the granted TTL back, so for at least
 * `granted − 1` seconds after it every answer is ≥ 1. Hence:
 *  - an answer of 0 received at T means the lease expires by T + 1 s unless it is renewed;
 *  - if every answer since then said 0, each received less than a second after the previous one
 *    was asked (so none can have missed a renewal), and the latest was received after T + 1 s,
 *    the lease was not renewed and has expired at etcd. etcd does not renew an expired lease (a
 *    late keep-alive waits for its revocation and fails), so revoking it then only does what
 *    etcd was about to do. The holder itself stopped leading at its own deadline, a safety margin
 *    before the expiry.
 * This holds for a granted TTL of 2 s or more (etcd's minimum with its default timing); a shorter
 * lease is left to etcd.
 */

/** Pause between answers while the lease has less than two seconds left. */
export const CLOSE_CHECK_MS = 50;
/** Two answers further apart than this (asked → received) cannot rule out a renewal between them. */
const MAX_GAP_MS = 900;
/** Slack for the standby's clock running slower than etcd's over one second. */
const CLOCK_SLACK_MS = 20;

/** What the answers so far prove: expired (revoke it), gone (revoked), or neither yet. */
export type LeaseVerdict = 'expired' | 'gone' | 'live';

export class LeaseExpiryWatch {
  /** When the first answer of 0 in the current run of zeros was received. */
  private zeroSince?: number;
  /** When the previous answer was asked for. */
  private previousAskedAt?: number;

  /** How long to wait before asking again, after the latest answer (0: ask now). */
  checkInMs = 0;

  constructor(readonly leaseId: string) {}

  /**
   * Feeds one TimeToLive answer, asked for at `askedAt` and received at `receivedAt` (monotonic
   * milliseconds), and says what etcd's answers so far prove.
   */
  observe(ttlSeconds: number, grantedSeconds: number, askedAt: number, receivedAt: number): LeaseVerdict {
    const previousAskedAt = this.previousAskedAt;
    this.previousAskedAt = askedAt;
    if (ttlSeconds < 0) return 'gone';
    if (ttlSeconds >= 1 || grantedSeconds < 2) {
      this.zeroSince = undefined;
      // With ≥ 2 s left, it cannot fall under one second before the next look.
      this.checkInMs = ttlSeconds >= 2 || grantedSeconds < 2 ? MAX_GAP_MS : CLOSE_CHECK_MS;
      return 'live';
    }
    if (
      this.zeroSince === undefined ||
      previousAskedAt === undefined ||
      receivedAt - previousAskedAt >= MAX_GAP_MS
    ) {
      this.zeroSince = receivedAt;
    }
    const expiredAt = this.zeroSince + 1000 + CLOCK_SLACK_MS;
    if (receivedAt >= expiredAt) return 'expired';
    this.checkInMs = Math.min(CLOSE_CHECK_MS, expiredAt - receivedAt);
    return 'live';
  }
}
