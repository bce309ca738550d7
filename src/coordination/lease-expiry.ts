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
 *  - if every answer since then said 0, each received less than 900 ms after the previous one
 *    was asked (so none can have missed a renewal), and the latest was *asked* after T + 1 s (so
 *    etcd computed it after that instant: an answer computed earlier and received late could hide
 *    a renewal that came after it), the lease was not renewed and has expired at etcd. etcd does
 *    not renew an expired lease (a late keep-alive waits for its revocation and fails), so
 *    revoking it then only does what etcd was about to do. The holder itself stopped leading at
 *    its own deadline, a safety margin before the expiry.
 * This holds for a granted TTL of 2 s or more (etcd's minimum with its default timing); a shorter
 * lease is left to etcd. It also needs the answers to come from etcd's real leader: in etcd 3.4 a
 * member answers TimeToLive from its own lessor when it believes it leads, and a leader cut off
 * from its quorum believes so until it notices. So a run of zeros must all carry one raft term,
 * and the caller confirms that term with a linearizable read before revoking (a term has one
 * leader, and a quorum read in it proves that leader was the real one).
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
  /** The raft term every answer of the current run of zeros carried. */
  private zeroTerm?: string;

  /** How long to wait before asking again, after the latest answer (0: ask now). */
  checkInMs = 0;

  constructor(readonly leaseId: string) {}

  /** The raft term of the answers that proved the expiry: confirm it with a quorum read. */
  get term(): string | undefined {
    return this.zeroTerm;
  }

  /**
   * Feeds one TimeToLive answer, asked for at `askedAt` and received at `receivedAt` (monotonic
   * milliseconds), carrying `term` (the response header's raft term), and says what etcd's
   * answers so far prove.
   */
  observe(
    ttlSeconds: number,
    grantedSeconds: number,
    askedAt: number,
    receivedAt: number,
    term = '',
  ): LeaseVerdict {
    const previousAskedAt = this.previousAskedAt;
    this.previousAskedAt = askedAt;
    if (ttlSeconds < 0) return 'gone';
    if (ttlSeconds >= 1 || grantedSeconds < 2) {
      this.zeroSince = undefined;
      this.zeroTerm = undefined;
      // With ≥ 2 s left, it cannot fall under one second before the next look.
      this.checkInMs = ttlSeconds >= 2 || grantedSeconds < 2 ? MAX_GAP_MS : CLOSE_CHECK_MS;
      return 'live';
    }
    if (
      this.zeroSince === undefined ||
      previousAskedAt === undefined ||
      receivedAt - previousAskedAt >= MAX_GAP_MS ||
      term !== this.zeroTerm
    ) {
      this.zeroSince = receivedAt;
      this.zeroTerm = term;
    }
    const expiredAt = this.zeroSince + 1000 + CLOCK_SLACK_MS;
    if (askedAt >= expiredAt) return 'expired';
    this.checkInMs = Math.min(CLOSE_CHECK_MS, Math.max(0, expiredAt - receivedAt));
    return 'live';
  }
}
