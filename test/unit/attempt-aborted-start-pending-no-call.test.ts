import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { ClaimLostError } from '../../src/errors.js';
import { runAttempt, WorkerStoppingError, type AttemptContext } from '../../src/execution/attempt.js';
import { DbClock } from '../../src/execution/db-clock.js';
import { HttpExecutor } from '../../src/execution/http-executor.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { Connections } from '../../src/store/pool-share.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';
import { TargetServer } from '../support/execution.js';

// A run claimed ahead (startPending) whose signal is aborted is not STARTed. When the abort reason is a lost claim (claim watch, or the poller's re-claim
// superseding it) and no drain is under way, whyNotStart returns undefined and runAttempt goes on
// to executor.execute with the aborted signal. These check, with the real HttpExecutor and a real
// target, that no request reaches the target on any of those paths (and that nothing is written).

const target = new TargetServer();
let url: string;
before(async () => {
  url = await target.start();
});
after(async () => {
  await target.close();
});

function harness(start: (run: ClaimedRun) => Promise<boolean>) {
  const sql: string[] = [];
  const record = async (text: unknown) => {
    sql.push(typeof text === 'string' ? text : String((text as { text?: string }).text));
    // A release "succeeds" (one row): lets the hand-back path run to its end.
    return { rows: [] };
  };
  const client = { query: record, on() {}, removeListener() {}, release() {} };
  const pool = { connect: async () => client, query: record } as unknown as Connections;
  const executor = new HttpExecutor();
  const ctx: AttemptContext = {
    pool,
    nodeId: 'node-a',
    executor,
    topics: { runsTopic: 'runs', deadLetterTopic: 'dead' },
    clock: new DbClock(),
    start,
    complete: async () => true,
    logger: silentLogger,
    metrics: createMetrics('test'),
  };
  return { ctx, sql, executor };
}

let n = 0;
function run(overrides: Partial<ClaimedRun> = {}): ClaimedRun {
  n += 1;
  return {
    ...fakeClaimedRun(`00000000-0000-4000-8000-0000000000${String(n).padStart(2, '0')}`),
    target: { url: `${url}/r${n}` },
    timeoutMs: 200,
    claimExpiresAt: new Date(Date.now() + 60_000),
    startPending: true,
    ...overrides,
  };
}

test('aborted (claim lost) before its time, no drain: not STARTed, no request, nothing written', async () => {
  let starts = 0;
  const h = harness(async () => {
    starts += 1;
    return true;
  });
  const cancel = new AbortController();
  cancel.abort(new ClaimLostError('run is now queued'));
  const r = run({ notBefore: new Date(Date.now() + 800) });
  const before = target.requests.length;
  await runAttempt(h.ctx, r, cancel.signal, undefined, () => undefined);
  await sleep(50);
  await h.executor.close();
  assert.equal(starts, 0);
  assert.equal(target.requests.length - before, 0, 'a request reached the target');
  assert.deepEqual(h.sql, [], 'nothing may be written for a claim this node no longer holds');
  // No call was made: none is counted as a call whose outcome was discarded (that alert fired once
  // per run claimed ahead when a pause withdrew a herd's runs).
  assert.equal((await h.ctx.metrics.staleCompletions.get()).values[0]?.value ?? 0, 0);
  const executed = (await h.ctx.metrics.runsExecuted.get()).values.map(
    (v) => `${v.labels.outcome}=${v.value}`,
  );
  assert.deepEqual(executed, ['claim-lost=1']);
});

test('claim lost while its START was in flight (START still answers true): no request', async () => {
  const cancel = new AbortController();
  const h = harness(async () => {
    cancel.abort(new ClaimLostError('run was claimed again by this node'));
    return true;
  });
  const before = target.requests.length;
  await runAttempt(h.ctx, run(), cancel.signal);
  await sleep(50);
  await h.executor.close();
  assert.equal(target.requests.length - before, 0, 'a request reached the target');
});

test('drain abort while START was in flight, run() entered before the drain began (no drainLeftMs): no request, claim handed back', async () => {
  const cancel = new AbortController();
  const h = harness(async () => {
    cancel.abort(new WorkerStoppingError('worker is stopping'));
    return true;
  });
  const before = target.requests.length;
  await runAttempt(h.ctx, run(), cancel.signal);
  await sleep(50);
  await h.executor.close();
  assert.equal(target.requests.length - before, 0, 'a request reached the target');
  assert.ok(
    h.sql.some((q) => q.includes("state = 'queued'")),
    'the claim is handed back (release)',
  );
});

test('control: the same run, not aborted, is STARTed and reaches the target once', async () => {
  let starts = 0;
  const h = harness(async () => {
    starts += 1;
    return true;
  });
  const before = target.requests.length;
  await runAttempt(h.ctx, run(), new AbortController().signal);
  await h.executor.close();
  assert.equal(starts, 1);
  assert.equal(target.requests.length - before, 1);
});
