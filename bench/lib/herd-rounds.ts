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

/**
 * Herds each contender's fresh processes get before the measured one: the cold herd, and with
 * `--warmups N` (N > 1) N − 1 more, unmeasured, whose last arrivals are printed. A V8 log of the
 * nodes (`--log-function-events`) showed the hot path's functions (undici's dispatch, pg's row
 * handling, the streams' writes, prom-client's observe) compiled by Maglev in the cold herd and by
 * TurboFan only in the second: a process makes one herd's calls per herd, and each of Helios's three
 * nodes (or a peer's three processes, or the floor's three clients) makes a third of them, so the
 * second herd still pays for compiling what a long-running process has compiled long since.
 * `--warmups 2` measures the third herd instead (docs/performance.md, seventh session).
 */
export const DEFAULT_WARMUP_HERDS = 1;

/** `--warmups`' value: a whole number ≥ 1, or the default. */
export function warmupHerds(value: string | undefined): number {
  if (value === undefined) return DEFAULT_WARMUP_HERDS;
  const n = Number(value);
  if (!Number.isInteger(n) || n < 1) throw new Error(`--warmups must be a whole number ≥ 1, got ${value}`);
  return n;
}
