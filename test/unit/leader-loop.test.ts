import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { Leadership } from '../../src/coordination/election.js';
import { runLeaderLoop } from '../../src/coordination/leader-loop.js';
import { NotLeaderError, StaleFencingTokenError } from '../../src/errors.js';
import { silentLogger } from '../../src/observability/logger.js';
import { createMetrics } from '../../src/observability/metrics.js';

// runLeaderLoop counts the passes that failed and are tried again (helios_leader_pass_failures_total,
// by loop), which HeliosLeaderPassesFailing watches; an ended epoch and a fence rejection are not
// such failures (the latter has its own counter).

function leadership(controller: AbortController): Leadership {
  return {
    nodeId: 'n',
    token: 7n,
    since: new Date(),
    signal: controller.signal,
    isValid: () => !controller.signal.aborted,
  };
}

async function failuresAfter(
  outcomes: (Error | 'ok' | 'end')[],
): Promise<{ failures: number; fenced: number }> {
  const controller = new AbortController();
  const metrics = createMetrics('loop-test');
  let fenced = 0;
  let k = 0;
  await runLeaderLoop({
    leadership: leadership(controller),
    name: 'reaper',
    pass: async () => {
      const outcome = outcomes[k++] ?? 'end';
      if (outcome === 'end') return controller.abort();
      if (outcome !== 'ok') throw outcome;
    },
    wait: async () => undefined,
    maxBackoffMs: 1,
    onFenced: () => void (fenced += 1),
    logger: silentLogger,
    metrics,
  });
  const metric = await metrics.leaderPassFailures.get();
  const reaper = metric.values.find((v) => v.labels.loop === 'reaper');
  return { failures: reaper?.value ?? 0, fenced };
}

test('each failed pass is counted under its loop, and the loop goes on', async () => {
  const cancelled = Object.assign(new Error('canceling statement due to statement timeout'), {
    code: '57014',
  });
  assert.deepEqual(await failuresAfter([cancelled, 'ok', cancelled, cancelled, 'ok']), {
    failures: 3,
    fenced: 0,
  });
});

test('an ended epoch and a fence rejection are not counted as failed passes', async () => {
  assert.deepEqual(await failuresAfter([new NotLeaderError('ended')]), { failures: 0, fenced: 0 });
  assert.deepEqual(await failuresAfter([new StaleFencingTokenError(7n)]), { failures: 0, fenced: 1 });
});
