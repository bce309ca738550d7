/**
 * Every herd benchmark (Helios' bench/herd.ts, the peers' bench/peers/herd.ts and the floor's
 * bench/http-floor.ts) gives its freshly started processes two herds of the same size: the first
 * (cold) includes the processes' JIT warm-up, which on this machine made the first of three herds
 * on one Helios cluster take 2.32 s against 1.68 s and 1.46 s for the next two. A scheduler meets
 * the top of the hour after running for a long time, so the second herd (warm) is the measured
 * figure, and the cold one is reported beside it. Every contender gets exactly this treatment.
 */

/**
 * From the cold herd's last arrival to the warm herd's insert (or, for the floor, its burst): the
 * cold herd's completions and would-be duplicates land and the processes are idle again.
 */
export const HERD_SETTLE_MS = 2000;
