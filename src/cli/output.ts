/** Where a command writes; injectable so tests and main.ts share one code path. */
export interface Output {
  out(text: string): void;
  err(text: string): void;
}

/**
 * Characters a terminal may act on instead of showing: C0 controls but tab and newline (ESC
 * starts colour, cursor and title sequences; CR overwrites a line), DEL, C1 controls (U+009B is
 * a one-character CSI) and the Unicode bidirectional overrides and isolates that reorder what is
 * shown. Values printed by the CLI come from job definitions and targets' responses: a target
 * must not be able to rewrite an operator's screen.
 */
const TERMINAL_UNSAFE =
  // eslint-disable-next-line no-control-regex -- matching control characters is the point
  /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;

/**
 * `text` with every terminal-unsafe character written as a `\uXXXX` escape: visible, inert, and
 * inside a JSON string the same value (so `--json` output stays valid JSON of the same data).
 */
export function terminalSafe(text: string): string {
  return text.replace(TERMINAL_UNSAFE, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

const line = (text: string) => terminalSafe(text.endsWith('\n') ? text : `${text}\n`);

export const processOutput: Output = {
  out: (text) => process.stdout.write(line(text)),
  err: (text) => process.stderr.write(line(text)),
};

/** A cell: null and undefined print as "-", long text is cut with an ellipsis. */
function cell(value: unknown, max = 60): string {
  if (value === null || value === undefined || value === '') return '-';
  const text = String(value).replace(/\s+/g, ' ');
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

/** Left-aligned columns separated by two spaces, headers in capitals. */
export function table(headers: readonly string[], rows: readonly (readonly unknown[])[]): string {
  const cells = [headers.map((h) => h.toUpperCase()), ...rows.map((row) => row.map((v) => cell(v)))];
  const widths = headers.map((_, i) => Math.max(...cells.map((row) => row[i]?.length ?? 0)));
  return cells
    .map((row) =>
      row
        .map((text, i) => (i === row.length - 1 ? text : text.padEnd(widths[i] ?? 0)))
        .join('  ')
        .trimEnd(),
    )
    .join('\n');
}

/** `key  value` lines for one object; nested objects are shown as compact JSON. */
export function details(entries: readonly (readonly [string, unknown])[]): string {
  const width = Math.max(...entries.map(([key]) => key.length));
  return entries
    .map(([key, value]) => {
      const text = value !== null && typeof value === 'object' ? JSON.stringify(value) : cell(value, 200);
      return `${key.padEnd(width)}  ${text}`;
    })
    .join('\n');
}

export const json = (value: unknown) => JSON.stringify(value, null, 2);
