import { noop } from 'cockatiel';
import { Etcd3 } from 'etcd3';

/**
 * An etcd client with bounded calls. The library's default circuit breaker keeps failing calls for
 * 5 s after etcd comes back; our loops already retry on their own schedule, so calls go straight
 * through and each unary call has a deadline.
 */
export function createEtcdClient(endpoints: readonly string[], callTimeoutMs = 2000): Etcd3 {
  return new Etcd3({
    hosts: [...endpoints],
    dialTimeout: callTimeoutMs,
    defaultCallOptions: (context) => (context.isStream ? {} : { deadline: Date.now() + callTimeoutMs }),
    faultHandling: { host: () => noop, global: noop },
  });
}
