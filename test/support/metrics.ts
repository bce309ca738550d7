/** One sample of a Prometheus text exposition: name, labels, value. */
export interface Sample {
  readonly name: string;
  readonly labels: Readonly<Record<string, string>>;
  readonly value: number;
}

/** The samples of a scrape, with lookups by name and labels. */
export class Scrape {
  constructor(readonly samples: readonly Sample[]) {}

  /** Samples of `name` whose labels include `labels`. */
  find(name: string, labels: Record<string, string> = {}): Sample[] {
    return this.samples.filter(
      (s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v),
    );
  }

  /** The value of the one sample of `name` matching `labels`; undefined when there is none. */
  value(name: string, labels: Record<string, string> = {}): number | undefined {
    const found = this.find(name, labels);
    if (found.length > 1)
      throw new Error(`${found.length} samples of ${name} match ${JSON.stringify(labels)}`);
    return found[0]?.value;
  }

  /** Sum over the samples of `name` matching `labels` (0 when there is none). */
  sum(name: string, labels: Record<string, string> = {}): number {
    return this.find(name, labels).reduce((total, s) => total + s.value, 0);
  }

  /** Names of the metric families exposed (from the `# TYPE` lines). */
  readonly families = new Set<string>();
}

/** Parses the text format prom-client writes (no escapes inside label values are needed here). */
export function parseMetrics(text: string): Scrape {
  const samples: Sample[] = [];
  const families: string[] = [];
  for (const line of text.split('\n')) {
    const type = /^# TYPE (\S+) /.exec(line);
    if (type) families.push(type[1]!);
    if (!line || line.startsWith('#')) continue;
    const match = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)/.exec(line);
    if (!match) continue;
    const labels: Record<string, string> = {};
    for (const pair of (match[2] ?? '').matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]!] = pair[2]!;
    samples.push({ name: match[1]!, labels, value: Number(match[3]) });
  }
  const scrape = new Scrape(samples);
  for (const f of families) scrape.families.add(f);
  return scrape;
}

/** GET {apiUrl}/metrics (open mode, or with `token`) and parse it. */
export async function scrapeMetrics(apiUrl: string, token?: string): Promise<Scrape> {
  const response = await fetch(`${apiUrl}/metrics`, {
    headers: token ? { authorization: `Bearer ${token}` } : {},
  });
  if (response.status !== 200) throw new Error(`/metrics answered ${response.status}`);
  return parseMetrics(await response.text());
}
