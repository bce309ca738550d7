// Preloaded into a Helios node by bench/churn.ts (`node --import bench/lib/resource-probe.mjs`):
// every $HELIOS_BENCH_PROBE_MS (10,000) it forces a full garbage collection, then appends one
// JSON line to $HELIOS_BENCH_PROBE_DIR/<pid>.jsonl with the V8 heap used after it, the heap
// spaces, external memory and the handles and requests keeping the event loop busy
// (process.getActiveResourcesInfo(), counted by kind). What grows with the operations a node
// served, rather than levelling off, is a leak. Bench tooling only: a node started without this
// module is unchanged. SIGUSR2 writes a heap snapshot to $HELIOS_BENCH_PROBE_DIR/<pid>-<n>.heapsnapshot
// (bench/lib/heap-diff.ts compares two).
import { appendFileSync } from 'node:fs';
import process from 'node:process';
import { setInterval } from 'node:timers';
import { getHeapSpaceStatistics, setFlagsFromString, writeHeapSnapshot } from 'node:v8';
import { runInNewContext } from 'node:vm';

const dir = process.env.HELIOS_BENCH_PROBE_DIR ?? '/tmp';
const everyMs = Number(process.env.HELIOS_BENCH_PROBE_MS ?? 10_000);

// `--expose-gc` is refused in NODE_OPTIONS; setting the flag at run time and fetching `gc` from a
// fresh context gives the same function without it.
setFlagsFromString('--expose-gc');
const gc = runInNewContext('gc');

function sample() {
  gc();
  const memory = process.memoryUsage();
  const spaces = Object.fromEntries(getHeapSpaceStatistics().map((s) => [s.space_name, s.space_used_size]));
  const resources = {};
  for (const kind of process.getActiveResourcesInfo()) resources[kind] = (resources[kind] ?? 0) + 1;
  const line = {
    at: Date.now(),
    heapUsed: memory.heapUsed,
    external: memory.external,
    arrayBuffers: memory.arrayBuffers,
    rss: memory.rss,
    spaces,
    resources,
  };
  appendFileSync(`${dir}/${process.pid}.jsonl`, `${JSON.stringify(line)}\n`);
}

setInterval(() => {
  try {
    sample();
  } catch (err) {
    process.stderr.write(`bench resource probe: ${err}\n`);
  }
}, everyMs).unref();

let snapshots = 0;
process.on('SIGUSR2', () => {
  try {
    gc();
    writeHeapSnapshot(`${dir}/${process.pid}-${++snapshots}.heapsnapshot`);
  } catch (err) {
    process.stderr.write(`bench resource probe: ${err}\n`);
  }
});
