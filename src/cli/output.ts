/** Where a command writes; injectable so tests and main.ts share one code path. */
export interface Output {
  out(text: string): void;
  err(text: string): void;
}

export const processOutput: Output = {
  out: (text) => process.stdout.write(text.endsWith('\n') ? text : `${text}\n`),
  err: (text) => process.stderr.write(text.endsWith('\n') ? text : `${text}\n`),
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
