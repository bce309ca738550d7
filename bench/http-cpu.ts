/**
 * CPU per call of the workers' HttpExecutor: a client process makes `calls` calls, `window` at a
 * time, to the recording target in this process, and reports its own CPU time (user + system,
 * `process.cpuUsage()`) divided by the calls, after a warm-up. The target runs in another process
 * so its CPU is not counted. Run it before and after a change to the executor or to undici.
 *
 *   npx tsx bench/http-cpu.ts [--calls 20000] [--window 200] [--repeat 3] [--plain]
 *
 * `--plain` measures the peers' call instead (a bare undici Agent.request, bench/peers/herd-worker.ts).
 * `--machinery` measures the worker around the call instead, without a database: `calls` runs
 * claimed ahead of one due instant go through the RunQueue (`window` slots) and runAttempt, START
 * and completion through MicroBatchers whose statements are one event-loop turn each, CPU counted
 * from the due instant to the last completion. Less the executor's own figure at the same window,
 * what the queue, the attempt and the batchers cost per run.
 */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { readFileSync } from 'node:fs';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { RecordingTarget } from './lib/target.js';
import { machine, median } from './lib/stats.js';

const WARMUP_CALLS = 2_000;

/**
 * The peers' call (bench/peers/herd-worker.ts): the same request through a bare undici Agent, no
 * timeout, policy, excerpt or report. What the executor adds is the difference.
 */
async function plainCaller(
  url: string,
): Promise<{ call: (i: number) => Promise<boolean>; close: () => Promise<void> }> {
  const { Agent } = await import('undici');
  const { peerCall } = await import('./lib/peer-call.js');
  const agent = new Agent({ keepAliveTimeout: 4_000, allowH2: false });
  const scheduledFor = new Date().toISOString();
  return {
    call: async (i) => {
      const status = await peerCall(agent, url, `cpu-${i}`, scheduledFor);
      return status >= 200 && status < 300;
    },
    close: () => agent.close(),
  };
}

/**
 * The worker's machinery around the call, without PostgreSQL: a RunQueue (claims answered at once,
 * claimed ahead of one due instant, as a herd's are) and runAttempt with START and completion going
 * through MicroBatchers whose statements are replaced by a turn of the event loop. `window` is the
 * queue's concurrency. Returns a function that runs a herd of `calls` runs and resolves with the
 * µs of CPU per run from the due instant until the last completion.
 */
async function machineryHerd(url: string, window: number) {
  const { RunQueue } = await import('../src/execution/run-queue.js');
  const { runAttempt } = await import('../src/execution/attempt.js');
  const { MicroBatcher } = await import('../src/execution/micro-batcher.js');
  const { DbClock } = await import('../src/execution/db-clock.js');
  const { HttpExecutor } = await import('../src/execution/http-executor.js');
  const { createMetrics } = await import('../src/observability/metrics.js');
  const { silentLogger } = await import('../src/observability/logger.js');
  const { MAX_BATCH, MAX_IN_FLIGHT } = await import('../src/execution/batching.js');
  const { fakeClaimedRun } = await import('../test/support/claimed-run.js');
  const turn = () => new Promise<void>((resolve) => setImmediate(resolve));
  let completed = 0;
  let onCompleted = () => undefined as void;
  // What batching.ts gives the worker, with each statement replaced by one turn of the event loop.
  const starts = new MicroBatcher<unknown, boolean>(
    async (items) => (await turn(), items.map(() => true)),
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
  const completions = new MicroBatcher<unknown, boolean>(
    async (items) => {
      await turn();
      completed += items.length;
      onCompleted();
      return items.map(() => true);
    },
    MAX_BATCH,
    MAX_IN_FLIGHT,
  );
  const clock = new DbClock();
  const metrics = createMetrics('machinery');
  const executor = new HttpExecutor();
  const context = {
    pool: undefined as never,
    nodeId: 'machinery',
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dlq' },
    clock,
    start: (run: { id: string }) => starts.add(run.id),
    complete: (run: { id: string }) => completions.add(run.id),
    logger: silentLogger,
    metrics,
  };
  let due = new Date();
  const queue = new RunQueue({
    claim: async (message) => ({
      kind: 'claimed',
      run: {
        ...fakeClaimedRun(message.runId),
        scheduledFor: due,
        target: { url: `${url}/tick`, method: 'POST', headers: {}, body: { bench: true } },
        timeoutMs: 60_000,
        notBefore: due,
        claimExpiresAt: new Date(due.getTime() + 600_000),
        startPending: true,
      },
    }),
    claimLeadMs: 1_000,
    concurrency: window,
    claimGraceMs: 600_000,
    prefetch: 1_000_000,
    clock,
    run: (run, signal, left, ended, untilSlot) => runAttempt(context, run, signal, left, ended, untilSlot),
    onBackpressure: () => undefined,
    logger: silentLogger,
    metrics,
  });
  let herd = 0;
  const run = async (calls: number): Promise<number> => {
    herd += 1;
    completed = 0;
    due = new Date(Date.now() + 1_500);
    for (let i = 0; i < calls; i++) {
      const runId = `00000000-0000-4000-8${String(herd).padStart(3, '0')}-${String(i).padStart(12, '0')}`;
      queue.hold({ runId, jobId: runId, attempt: 1, scheduledFor: due, notBefore: due });
    }
    await new Promise((resolve) => setTimeout(resolve, due.getTime() - Date.now()));
    const before = process.cpuUsage();
    await new Promise<void>((resolve) => {
      onCompleted = () => (completed >= calls ? resolve() : undefined);
      onCompleted();
    });
    const used = process.cpuUsage(before);
    return (used.user + used.system) / calls;
  };
  return { run, close: () => executor.close() };
}

/** One client: warm-up, then `calls` calls `window` at a time; sends µs of CPU per call and failures. */
async function client(url: string, calls: number, window: number, mode: string): Promise<void> {
  if (mode === 'machinery') {
    const herd = await machineryHerd(url, window);
    await herd.run(WARMUP_CALLS);
    const perCall = await herd.run(calls);
    await herd.close();
    process.send!({ perCall, failed: 0 });
    return;
  }
  const plain = mode === 'plain';
  const { HttpExecutor } = await import('../src/execution/http-executor.js');
  const executor = new HttpExecutor();
  const bare = plain ? await plainCaller(url) : undefined;
  let sent = 0;
  let failed = 0;
  let firstFailure: string | undefined;
  const scheduledFor = new Date();
  const one = async (i: number) => {
    if (bare) {
      if (!(await bare.call(i))) {
        failed++;
        firstFailure ??= `call ${i}: not 2xx`;
      }
      return;
    }
    // Every call gets its own signal, as a worker gives it.
    const report = await executor.execute(
      {
        id: `cpu-${i}`,
        jobId: 'http-cpu',
        attempt: 1,
        scheduledFor,
        target: { url: `${url}/tick`, method: 'POST', headers: {}, body: { bench: true } },
        // Generous: a loaded machine must not turn a slow call into a failed run.
        timeoutMs: 60_000,
      },
      new AbortController().signal,
    );
    if (report.outcome !== 'succeeded') {
      failed++;
      firstFailure ??= `call ${i}: ${report.outcome} ${report.error}`;
    }
  };
  const batch = async (total: number) => {
    const lane = async () => {
      while (sent < total) await one(sent++);
    };
    await Promise.all(Array.from({ length: window }, lane));
  };
  await batch(WARMUP_CALLS);
  sent = 0;
  const before = process.cpuUsage();
  await batch(calls);
  const used = process.cpuUsage(before);
  await executor.close();
  await bare?.close();
  process.send!({ perCall: (used.user + used.system) / calls, failed, firstFailure });
}

async function main(): Promise<void> {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      client: { type: 'boolean', default: false },
      calls: { type: 'string', default: '20000' },
      window: { type: 'string', default: '200' },
      repeat: { type: 'string', default: '3' },
      plain: { type: 'boolean', default: false },
      machinery: { type: 'boolean', default: false },
    },
  });
  if (values.client)
    return client(positionals[0]!, Number(positionals[1]), Number(positionals[2]), positionals[3]!);
  // The target in a child process of its own, so only the client's CPU is counted.
  const target = fork(fileURLToPath(import.meta.url), ['--target']);
  const [url] = (await once(target, 'message')) as [string];
  const figures: number[] = [];
  try {
    for (let r = 0; r < Number(values.repeat); r++) {
      const child = fork(fileURLToPath(import.meta.url), [
        '--client',
        url,
        values.calls,
        values.window,
        values.machinery ? 'machinery' : values.plain ? 'plain' : 'executor',
      ]);
      let result: { perCall: number; failed: number; firstFailure?: string } | undefined;
      child.once('message', (m: typeof result) => (result = m));
      const [code] = (await once(child, 'exit')) as [number | null];
      if (result === undefined) throw new Error(`client exited with ${code} before reporting`);
      // A failed call costs less than a real one: say so rather than report a flattering figure.
      if (result.failed > 0) console.log(`  ${result.failed} calls failed, first: ${result.firstFailure}`);
      figures.push(result.perCall);
    }
  } finally {
    target.kill();
  }
  const undici = new URL('../node_modules/undici/package.json', import.meta.url);
  const { version } = JSON.parse(readFileSync(undici, 'utf8')) as { version: string };
  console.log(
    `${values.machinery ? 'the worker around its calls (RunQueue, runAttempt, batchers; no database), a herd:' : values.plain ? "bare undici Agent.request (the peers' call)" : 'HttpExecutor'} CPU per call (undici ${version}, ${values.calls} calls, ${values.window} at a time), ${machine()}: ` +
      `median ${median(figures).toFixed(1)} µs (runs: ${figures.map((f) => f.toFixed(1)).join(', ')})`,
  );
}

/** The target process: the benchmarks' recording server, its URL sent to the parent. */
async function serve(): Promise<void> {
  const target = new RecordingTarget();
  process.send!(await target.start());
  process.on('SIGTERM', () => void target.close().then(() => process.exit(0)));
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) {
  (process.argv.includes('--target') ? serve() : main()).catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
