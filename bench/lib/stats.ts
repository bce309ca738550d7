import { cpus } from 'node:os';

/** Percentile (nearest rank) of `values`; NaN when empty. */
export function percentile(values: readonly number[], p: number): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))] ?? NaN;
}

/**
 * When each tenth of `values` was reached: p10, p20, … p90, as `a / b / …` ms. Shows where a herd
 * slows down (its first half against its second), which its first, median and last call do not.
 */
export function deciles(values: readonly number[]): string {
  return [10, 20, 30, 40, 50, 60, 70, 80, 90].map((p) => Math.round(percentile(values, p))).join(' / ');
}

/** Median of `values` (the lower middle for an even count, so it is always a measured value). */
export function median(values: readonly number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor((sorted.length - 1) / 2)] ?? NaN;
}

export function max(values: readonly number[]): number {
  return values.reduce((a, b) => Math.max(a, b), -Infinity);
}

/** A millisecond figure for a table: whole ms from 10 ms on, one decimal below. */
export function ms(value: number): string {
  if (!Number.isFinite(value)) return 'n/a';
  return Math.abs(value) >= 10 ? `${Math.round(value)} ms` : `${value.toFixed(1)} ms`;
}

/** What the figures were measured on. */
export function machine(): string {
  const list = cpus();
  return `${list.length} cores (${list[0]?.model.trim() ?? 'unknown cpu'}), Node ${process.version}`;
}

/** Prints rows as an aligned text table (first row = header). */
export function table(rows: readonly (readonly string[])[]): string {
  const widths = rows[0]!.map((_, column) => Math.max(...rows.map((row) => (row[column] ?? '').length)));
  const line = (row: readonly string[]) =>
    row
      .map((cell, column) => cell.padEnd(widths[column]!))
      .join('  ')
      .trimEnd();
  return [line(rows[0]!), widths.map((w) => '-'.repeat(w)).join('  '), ...rows.slice(1).map(line)].join('\n');
}

/** Wall-clock milliseconds with sub-millisecond precision (comparable across processes). */
export function nowMs(): number {
  return performance.timeOrigin + performance.now();
}
