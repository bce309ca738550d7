import {
  BrokenCircuitError,
  circuitBreaker,
  CircuitState,
  ConsecutiveBreaker,
  handleWhen,
  noop,
  type IPolicy,
} from 'cockatiel';
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
 *
 * While a member's one trial call is out, other calls pass it over too (memberBreaker).
 */
export function createEtcdClient(endpoints: readonly string[], callTimeoutMs = 2000): Etcd3 {
  return new Etcd3({
    hosts: [...endpoints],
    dialTimeout: callTimeoutMs,
    defaultCallOptions: (context) => (context.isStream ? {} : { deadline: Date.now() + callTimeoutMs }),
    faultHandling: {
      host: memberBreaker,
      global: noop,
    },
  });
}

/**
 * One member's breaker (see createEtcdClient). Half-open, cockatiel's breaker lets one trial call
 * through and makes every other call to the member wait for the trial's outcome. A trial sent to a
 * member that does not answer (cut off, or blocked by a defragmentation) held the calls behind it
 * for its whole deadline (2 s); they then went on to a healthy member with their own deadline
 * spent, failed there and opened that member's breaker as well. A leader's keep-alive that queued
 * so lost its try; with the node's other reads on the client (EndedEpochs reads every second) a
 * leader given two members, one of them not answering, stepped down. So a call that finds the
 * trial out passes the member over, as an open breaker makes it do.
 */
function memberBreaker(): IPolicy {
  const breaker = circuitBreaker(
    handleWhen((err) => isRecoverableError(err) && !(err instanceof GRPCCancelledError)),
    { halfOpenAfter: SKIP_FAILED_MEMBER_MS, breaker: new ConsecutiveBreaker(1) },
  );
  return {
    _altReturn: undefined as never, // a type-only field of IPolicy
    onSuccess: breaker.onSuccess,
    onFailure: breaker.onFailure,
    execute: (fn, signal) =>
      breaker.state === CircuitState.HalfOpen
        ? Promise.reject(new BrokenCircuitError())
        : breaker.execute(fn, signal),
  };
}
