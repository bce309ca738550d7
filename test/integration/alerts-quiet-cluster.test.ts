import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { waitFor } from '../support/execution.js';
import { apiCall } from '../support/node-api.js';
import { scrapeMetrics, type Scrape } from '../support/metrics.js';

// The alerts (deploy/prometheus/alerts.yml) on a healthy cluster doing ordinary things: real nodes,
// etcd, Kafka, PostgreSQL and a recording target. Overlapping `replace` and `forbid` jobs, a pause
// and a resume, an edit, a trigger, a failing target that dead-letters on purpose and a replay of
// its dead letter, then a graceful leader stop (failover) and a new node (a rolling restart).
// Only HeliosDeadLettersRising may have cause; every other alert's input stays quiet.
// (HeliosDbPoolWaiting needs callers waiting over half of 10 minutes, far beyond this test.)

let f: IntegrationFixture;
before(async () => {
  f = await integrationFixture({
    behaviour: (req) => {
      if (req.path.startsWith('/replace-status')) return { status: 200, bodyAfterMs: 1300 };
      if (req.path.startsWith('/replace')) return { status: 200, delayMs: 1300 };
      if (req.path.startsWith('/forbid')) return { status: 200, delayMs: 1500 };
      if (req.path.startsWith('/fail')) return { status: 500 };
      return { status: 200 };
    },
  });
});
after(() => f.teardown());

interface Job {
  id: string;
}

test(
  'ordinary operations on a healthy cluster leave every alert but dead letters quiet',
  { timeout: 180_000 },
  async () => {
    const a = await f.start('a', {}, { leader: true, worker: true });
    const b = await f.start('b', {}, { leader: false, worker: true });
    const every = (name: string, path: string, extra: Record<string, unknown> = {}) =>
      apiCall<Job>(a.apiUrl, 'POST', '/jobs', {
        name,
        schedule: '* * * * * *',
        target: { url: `${f.target.url}${path}` },
        timeoutMs: 5000,
        ...extra,
      });
    const replace = await every('replace', '/replace', { concurrency: 'replace' });
    await every('replace-status', '/replace-status', { concurrency: 'replace' });
    const forbid = await every('forbid', '/forbid', { concurrency: 'forbid' });
    const plain = await every('plain', '/ok');
    const failing = await every('failing', '/fail', { retry: { maxAttempts: 2, backoffMs: 200 } });

    const scrapes: Scrape[] = [];
    const gauges: { overdue: number; outboxAge: number; lag: number; waiting: number }[] = [];
    let sampling = true;
    /** The node that joins later (sampled once it is up). */
    const joined: { apiUrl?: string } = {};
    const sampler = (async () => {
      while (sampling) {
        for (const apiUrl of [a.apiUrl, b.apiUrl, joined.apiUrl]) {
          if (!apiUrl) continue;
          const s = await scrapeMetrics(apiUrl).catch(() => null);
          if (!s) continue;
          gauges.push({
            overdue: s.sum('helios_runs_overdue'),
            outboxAge: s.sum('helios_outbox_oldest_pending_age_seconds'),
            lag: s.sum('helios_kafka_consumer_lag_messages'),
            waiting: s.sum('helios_db_pool_waiting'),
          });
        }
        await sleep(500);
      }
    })();

    await sleep(6000);
    await apiCall(a.apiUrl, 'POST', `/jobs/${plain.id}/pause`);
    await sleep(1500);
    await apiCall(a.apiUrl, 'POST', `/jobs/${plain.id}/resume`);
    await apiCall(b.apiUrl, 'PATCH', `/jobs/${forbid.id}`, { timeoutMs: 4000 });
    await apiCall(b.apiUrl, 'PATCH', `/jobs/${replace.id}`, { timeoutMs: 4500 });
    await apiCall(a.apiUrl, 'POST', `/jobs/${plain.id}/trigger`);
    const letters = await waitFor(
      'a dead letter of the failing job',
      async () => {
        const page = await apiCall<{ items: { id: string; jobId: string }[] }>(
          a.apiUrl,
          'GET',
          '/dead-letters',
        );
        return page.items.length > 0 ? page.items : null;
      },
      20_000,
    );
    await apiCall(a.apiUrl, 'POST', `/dead-letters/${letters[0]!.id}/replay`);
    await sleep(3000);

    // A failover: the leader stops gracefully; b takes over. Then a new node joins (a rolling restart).
    scrapes.push(await scrapeMetrics(a.apiUrl));
    await a.node.stop();
    await b.node.waitForLog((l) => l.msg === 'became leader', 30_000);
    const c = await f.start('c', {}, { leader: false, worker: true });
    joined.apiUrl = c.apiUrl;
    await sleep(8000);
    sampling = false;
    await sampler;
    scrapes.push(await scrapeMetrics(b.apiUrl), await scrapeMetrics(c.apiUrl));

    const total = (name: string) => scrapes.reduce((sum, s) => sum + s.sum(name), 0);
    const quiet = {
      helios_stale_completions_total: total('helios_stale_completions_total'),
      helios_fence_rejections_total: total('helios_fence_rejections_total'),
      helios_leader_pass_failures_total: total('helios_leader_pass_failures_total'),
      helios_jobs_parked_total: total('helios_jobs_parked_total'),
      helios_starts_early_total: total('helios_starts_early_total'),
      helios_outbox_rows_refused_total: total('helios_outbox_rows_refused_total'),
      'helios_prune_passes_total{result!="succeeded"}':
        total('helios_prune_passes_total') -
        scrapes.reduce((sum, s) => sum + s.sum('helios_prune_passes_total', { result: 'succeeded' }), 0),
    };
    const most = (key: keyof (typeof gauges)[number]) => Math.max(0, ...gauges.map((g) => g[key]));
    const replaced = total('helios_runs_replaced_total');
    const skipped = scrapes.reduce((sum, s) => sum + s.sum('helios_runs_skipped_total'), 0);
    const report = JSON.stringify({
      quiet,
      replaced,
      skipped,
      deadLetters: total('helios_dead_letters_total'),
      most: {
        overdue: most('overdue'),
        outboxAge: most('outboxAge'),
        lag: most('lag'),
        waiting: most('waiting'),
      },
      samples: gauges.length,
    });
    assert.ok(replaced > 0 && skipped > 0, `the replace and forbid jobs overlapped: ${report}`);
    assert.deepEqual(
      quiet,
      Object.fromEntries(Object.keys(quiet).map((k) => [k, 0])),
      `counters of alerts that must stay quiet: ${report}`,
    );
    assert.ok(
      total('helios_dead_letters_total') >= 1,
      `the failing target's dead letters counted: ${report}`,
    );
    const { rows } = await f.db.pool.query<{ job: string }>(
      `SELECT DISTINCT job_id::text AS job FROM dead_letters`,
    );
    assert.deepEqual(
      rows.map((r) => r.job),
      [failing.id],
      'only the failing job dead-lettered',
    );
    // The new leader reads the cluster gauges (HeliosClusterGaugesStale) and prunes (HeliosPruningFailing).
    const fresh = scrapes[1]!.value('helios_cluster_signals_updated_timestamp_seconds')!;
    assert.ok(fresh > Date.now() / 1000 - 30, `the leader's cluster gauges read at ${fresh}: ${report}`);
    assert.ok(
      scrapes[1]!.sum('helios_prune_passes_total', { table: 'outbox', result: 'succeeded' }) > 0,
      `the new leader's pruner passes: ${report}`,
    );
    assert.ok(most('outboxAge') <= 30, `outbox age: ${report}`);
    assert.ok(most('lag') <= 1000, `Kafka lag: ${report}`);
    assert.equal(most('overdue'), 0, `overdue runs: ${report}`);
    console.log(report);
  },
);
