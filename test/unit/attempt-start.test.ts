import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { test } from 'node:test';
import { runAttempt, type AttemptContext } from '../../src/execution/attempt.js';
import { DbClock } from '../../src/execution/db-clock.js';
import type { HttpExecutor } from '../../src/execution/http-executor.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';
import type { AttemptReport } from '../../src/store/attempts.js';
import type { Connections } from '../../src/store/pool-share.js';
import type { ClaimedRun } from '../../src/store/runs.js';
import { fakeClaimedRun } from '../support/claimed-run.js';

// A run claimed ahead of its time is marked started (START) just before its call: where that round
// trip sits in runAttempt relative to the checks and writes around it. Fakes only, the real
// runAttempt.

interface Harness {
  ctx: AttemptContext;
  /** Calls made at the target. */
  calls: string[];
  /** SQL the attempt ran on the pool (releases and replaceOlderRuns). */
  sql: string[];
}

function harness(start: (run: ClaimedRun) => Promise<boolean>): Harness {
  const h: Harness = { ctx: undefined as unknown as AttemptContext, calls: [], sql: [] };
  const record = async (text: unknown) => {
    h.sql.push(typeof text === 'string' ? text : String((text as { text?: string }).text));
    return { rows: [] };
  };
  const client = { query: record, on() {}, removeListener() {}, release() {} };
  const pool = { connect: async () => client, query: record } as unknown as Connections;
  const executor = {
    execute: async (run: ClaimedRun, cancel: AbortSignal): Promise<AttemptReport> => {
      if (cancel.aborted) {
        return {
          outcome: 'cancelled',
          statusCode: null,
          durationMs: 0,
          error: 'aborted',
          responseExcerpt: null,
        };
      }
      h.calls.push(run.id);
      return { outcome: 'succeeded', statusCode: 200, durationMs: 1, error: null, responseExcerpt: null };
    },
  } as unknown as HttpExecutor;
  h.ctx = {
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
  return h;
}

const RUN = '00000000-0000-4000-8000-000000000001';

test('a claimed-ahead run whose START is answered only when its claim no longer covers its timeout is not called', async () => {
  // Claimed ahead, due now: claim deadline = not_before + timeout + grace (store/runs.ts CLAIM),
  // here a 300 ms grace. When START is sent 500 ms are left (> the 200 ms timeout), then START takes
  // 400 ms (a batch queued behind MAX_IN_FLIGHT, a pool wait, a lock wait, a failed batch retried
  // one by one, a late TCP answer): 100 ms of claim are left for a call that may take 200 ms, so it
  // can outlive its claim, be re-queued by the reaper and be called again elsewhere. The check that
  // the claim still covers the call (claim-too-late) must hold when the call begins, i.e. after START.
  const h = harness(async () => {
    await sleep(400);
    return true;
  });
  const now = Date.now();
  const run: ClaimedRun = {
    ...fakeClaimedRun(RUN),
    timeoutMs: 200,
    notBefore: new Date(now),
    claimExpiresAt: new Date(now + 200 + 300),
    startPending: true,
  };
  await runAttempt(h.ctx, run, new AbortController().signal);
  const left = run.claimExpiresAt.getTime() - Date.now();
  assert.deepEqual(
    h.calls,
    [],
    `the call began with ${left} ms of claim left for a ${run.timeoutMs} ms timeout (checked before START only)`,
  );
});

test('a claimed-ahead run whose START is answered after a drain left too little time is not called', async () => {
  // The same with a stopping worker: the drain aborts calls at its deadline (run-queue.ts drain),
  // so a call that cannot end before it must not begin (whyNotStart `stopping`).
  const h = harness(async () => {
    await sleep(400);
    return true;
  });
  const abortAt = performance.now() + 500;
  const run: ClaimedRun = {
    ...fakeClaimedRun(RUN),
    timeoutMs: 200,
    claimExpiresAt: new Date(Date.now() + 60_000),
    startPending: true,
  };
  await runAttempt(h.ctx, run, new AbortController().signal, () => abortAt - performance.now());
  assert.deepEqual(h.calls, [], 'the call began although the drain cuts it before its timeout');
});

test('a replace run withdrawn before its START does not replace the older running run of its job', async () => {
  // A replace run is claimed only when due, but within the skew tolerance before not_before, so
  // its claim can leave started_at NULL (startPending, see claim-ahead-interleavings.test.ts). Were
  // replaceOlderRuns (fails the older running run, aborts its call) run before START, a pause
  // that withdrew this run meanwhile would leave the job with its older call killed by a run that
  // never existed as far as the pause is concerned.
  const h = harness(async () => false);
  const run: ClaimedRun = { ...fakeClaimedRun(RUN), concurrency: 'replace', startPending: true };
  await runAttempt(h.ctx, run, new AbortController().signal);
  assert.deepEqual(h.calls, [], 'withdrawn: no call');
  const replaced = h.sql.filter((s) => s.includes("reason = 'replaced'"));
  assert.equal(replaced.length, 0, 'the older run was replaced by a withdrawn run');
});

test('control: a claimed-ahead run with time left is started, then called once', async () => {
  let starts = 0;
  const h = harness(async () => {
    starts += 1;
    return true;
  });
  const run: ClaimedRun = { ...fakeClaimedRun(RUN), startPending: true };
  await runAttempt(h.ctx, run, new AbortController().signal);
  assert.equal(starts, 1);
  assert.deepEqual(h.calls, [RUN]);
});

test('a START that fails (PostgreSQL restarting) is tried again while the claim covers the call; the run is called once', async () => {
  // One try only left every run claimed ahead of a PostgreSQL restart uncalled until the reaper
  // re-queued it after its claim expired: 8-19 s late in the chaos run's restart-postgres window.
  let tries = 0;
  const h = harness(async () => {
    tries += 1;
    if (tries < 4) throw new Error('connect ECONNREFUSED');
    return true;
  });
  const run: ClaimedRun = { ...fakeClaimedRun(RUN), startPending: true };
  await runAttempt(h.ctx, run, new AbortController().signal);
  assert.equal(tries, 4);
  assert.deepEqual(h.calls, [RUN]);
});

test('a START that keeps failing is given up once the claim no longer covers the call: no call, the claim handed back', async () => {
  let tries = 0;
  const h = harness(async () => {
    tries += 1;
    throw new Error('connection terminated');
  });
  const run: ClaimedRun = {
    ...fakeClaimedRun(RUN),
    timeoutMs: 200,
    claimExpiresAt: new Date(Date.now() + 600),
    startPending: true,
  };
  const began = Date.now();
  await runAttempt(h.ctx, run, new AbortController().signal);
  const tookMs = Date.now() - began;
  assert.ok(tries > 1, 'tried again while the claim had room');
  assert.ok(tookMs < 600, `gave up before the claim expired (${tookMs} ms)`);
  assert.deepEqual(h.calls, []);
  // Before, left to the reaper until its claim expired (test/integration/start-failed-hand-back.test.ts).
  assert.ok(
    h.sql.some((q) => q.includes("state = 'queued'")),
    'the claim is handed back',
  );
});

test('a claimed-ahead run aborted while it waited for its time (a drain) is handed back without START', async () => {
  // Marked started before it is due, then handed back, it would be called by the next worker
  // without START, so a pause landing before its time would no longer withdraw it.
  let starts = 0;
  const h = harness(async () => {
    starts += 1;
    return true;
  });
  const cancel = new AbortController();
  cancel.abort(new Error('drain'));
  const run: ClaimedRun = {
    ...fakeClaimedRun(RUN),
    timeoutMs: 200,
    notBefore: new Date(Date.now() + 800),
    claimExpiresAt: new Date(Date.now() + 60_000),
    startPending: true,
  };
  await runAttempt(h.ctx, run, cancel.signal, () => 0);
  assert.equal(starts, 0, 'START was sent for a run that is not called');
  assert.deepEqual(h.calls, []);
  assert.ok(
    h.sql.some((q) => q.includes("state = 'queued'")),
    'the claim is handed back',
  );
});
