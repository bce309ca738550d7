/**
 * Every herd benchmark (Helios' bench/herd.ts, the peers' bench/peers/herd.ts and the floor's
 * bench/http-floor.ts) gives its freshly started processes herds of the same size before the
 * measured one (DEFAULT_WARMUP_HERDS): the first (cold) includes the processes' JIT warm-up, and is
 * reported beside the measured (warm) herd, as is the second. A scheduler meets the top of the hour
 * after running for a long time, with its hot path compiled. Every contender gets exactly this
 * treatment.
 */

/**
 * From the cold herd's last arrival to the warm herd's insert (or, for the floor, its burst): the
 * cold herd's completions and would-be duplicates land and the processes are idle again.
 */
export const HERD_SETTLE_MS = 2000;

/**
 * Herds each contender's fresh processes get before the measured one: the cold herd and one more
 * (`--warmups N` changes it; their last arrivals are printed, the second's in the table). Until
 * 2026-12-07 the second herd was the measured one. A V8 log of Helios's nodes (`--log-deopt
 * --log-function-events`) then showed the hot path (undici's dispatch, pg's row handling, the
 * streams' writes, prom-client's observe) compiled by Maglev in the cold herd and by TurboFan only in
 * the second, as late as its last 200 ms (V8 tiers a function up to TurboFan after 3,000 calls or
 * so): a process makes its share of a herd's calls, a third for each of Helios's nodes (or a peer's
 * three processes), all 10,000 for a peer's one process, so the second herd measured the 3-process
 * contenders while they compiled what a long-running process has compiled long since
 * (docs/performance.md, seventh session).
 */
export const DEFAULT_WARMUP_HERDS = 2;

/** `--warmups`' value: a whole number ≥ 1, or the default. */
export function warmupHerds(value: string | undefined): number {
  if (value === undefined) return DEFAULT_WARMUP_HERDS;
  const n = Number(value);
  if (!Number.isInteger(n) || n < 1) throw new Error(`--warmups must be a whole number ≥ 1, got ${value}`);
  return n;
}
