/**
 * Compares two V8 heap snapshots of one process (bench/lib/resource-probe.mjs writes them on
 * SIGUSR2): objects by (type, constructor name) whose count or retained self size grew, biggest
 * growth first. What grows by about one per operation served between the snapshots is a leak.
 *
 *   npx tsx bench/lib/heap-diff.ts BEFORE.heapsnapshot AFTER.heapsnapshot [top]
 */
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

interface Snapshot {
  snapshot: { meta: { node_fields: string[]; node_types: [string[], ...unknown[]] } };
  nodes: number[];
  strings: string[];
}

/** Count and self size per "type name" of every object in a snapshot. */
export function census(path: string): Map<string, { count: number; size: number }> {
  const snap = JSON.parse(readFileSync(path, 'utf8')) as Snapshot;
  const fields = snap.snapshot.meta.node_fields;
  const types = snap.snapshot.meta.node_types[0];
  const width = fields.length;
  const [typeAt, nameAt, sizeAt] = ['type', 'name', 'self_size'].map((f) => fields.indexOf(f)) as [
    number,
    number,
    number,
  ];
  const out = new Map<string, { count: number; size: number }>();
  for (let i = 0; i < snap.nodes.length; i += width) {
    const type = types[snap.nodes[i + typeAt]!]!;
    // Strings and code are named by their content: one key per kind is enough for a census.
    const name =
      type === 'object' || type === 'closure' || type === 'native'
        ? snap.strings[snap.nodes[i + nameAt]!]!
        : '';
    const key = `${type} ${name.slice(0, 80)}`;
    const entry = out.get(key) ?? { count: 0, size: 0 };
    entry.count += 1;
    entry.size += snap.nodes[i + sizeAt]!;
    out.set(key, entry);
  }
  return out;
}

function main(): void {
  const [before, after, top = '30'] = process.argv.slice(2);
  if (!before || !after) throw new Error('usage: heap-diff BEFORE AFTER [top]');
  const a = census(before);
  const b = census(after);
  const rows = [...b].map(([key, v]) => {
    const was = a.get(key) ?? { count: 0, size: 0 };
    return { key, count: v.count, dCount: v.count - was.count, dSize: v.size - was.size };
  });
  rows.sort((x, y) => y.dSize - x.dSize);
  for (const r of rows.slice(0, Number(top)))
    console.log(
      `${String(r.dCount).padStart(8)} objects ${(r.dSize / 1024).toFixed(1).padStart(9)} KB  (now ${r.count})  ${r.key}`,
    );
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) main();
