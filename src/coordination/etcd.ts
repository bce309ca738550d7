import { circuitBreaker, ConsecutiveBreaker, handleWhen, noop } from 'cockatiel';
import { Etcd3, GRPCCancelledError, isRecoverableError } from 'etcd3';

/** How long an etcd member that failed a call is passed over before it is tried again. */
const SKIP_FAILED_MEMBER_MS = 1000;

/**
 * An etcd client with bounded calls that moves off a failed member. The library's pool sends each
 * call to one member and moves to the next only when a member's own policy refuses the call; with
 * no policy (what we had), every call to a dead or partitioned member of a 3-member cluster failed,
 * and the leader stepped down for a member it did not need (found by the chaos run's member
 * partitions). So each member gets a breaker that opens on one failure and lets a call through
 * again after SKIP_FAILED_MEMBER_MS: calls go to the healthy members meanwhile. The library's
 * default breaker (3 failures, 5 s open) kept a single-member cluster failing for 5 s after it came
 * back; 1 s is below every loop's own retry interval. No global retry: a retried campaign txn
 * whose first try had in fact been applied would read as a lost election.
 *
 * A cancelled call is not the member's failure: the library counts it as recoverable, so
 * cancelling a watch (the election on stop) passed over the only member for a second, and the
 * node's deregistration right after it failed.
 */
export function createEtcdClient(endpoints: readonly string[], callTimeoutMs = 2000): Etcd3 {
  return new Etcd3({
    hosts: [...endpoints],
    dialTimeout: callTimeoutMs,
    defaultCallOptions: (context) => (context.isStream ? {} : { deadline: Date.now() + callTimeoutMs }),
    faultHandling: {
      host: () =>
        circuitBreaker(
          handleWhen((err) => isRecoverableError(err) && !(err instanceof GRPCCancelledError)),
          {
            halfOpenAfter: SKIP_FAILED_MEMBER_MS,
            breaker: new ConsecutiveBreaker(1),
          },
        ),
      global: noop,
    },
  });
}
