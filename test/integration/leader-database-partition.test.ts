import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { uniqueId } from '../support/env.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { apiCall } from '../support/node-api.js';
import type { LogLine } from '../support/processes.js';
import { startTogether } from '../support/start-together.js';
import { TcpProxy } from '../support/tcp-proxy.js';

// README, "A leader that cannot reach PostgreSQL hands over": a leader cut off from PostgreSQL
// alone keeps its etcd lease, so etcd never replaces it. Its dispatcher commits nothing; after
// HELIOS_LEADER_STALL_MS it probes PostgreSQL on a new connection, and when that fails too it
// steps down, so that the node that can reach the database leads. With the default lookahead
// (5 s), misfire threshold (5 s) and stall limit (4 s) no occurrence misfires meanwhile, which a
// misfire `skip` job shows: a missed occurrence would leave no run at all.

let fixture: IntegrationFixture;
/** Each node reaches PostgreSQL through its own proxy, so whichever leads can be cut off alone. */
const proxies: TcpProxy[] = [];

interface JobAnswer {
  id: string;
  createdAt: string;
  updatedAt: string;
}

before(async () => {
  fixture = await integrationFixture();
  const db = new URL(fixture.db.url);
  for (let i = 0; i < 2; i++) {
    const proxy = new TcpProxy(db.hostname, Number(db.port || 5432));
    await proxy.listen();
    proxies.push(proxy);
  }
});
after(async () => {
  // Healed first, so the cut-off node can stop cleanly.
  for (const proxy of proxies) await proxy.close();
  await fixture.teardown();
});

const at = (line: LogLine) => Date.parse(line.time as string);

test(
  'a leader cut off from PostgreSQL alone steps down for the node that can reach it: every occurrence of a misfire "skip" job still runs',
  { timeout: 120_000 },
  async () => {
    const db = new URL(fixture.db.url);
    const nodes = await startTogether(
      fixture,
      proxies.map((proxy, i) => {
        const url = new URL(db);
        url.hostname = '127.0.0.1';
        url.port = String(proxy.port);
        return {
          name: `pg-cut-${i + 1}`,
          // A run the cut-off node had claimed comes back soon after its grace.
          extra: { HELIOS_DATABASE_URL: url.toString(), HELIOS_CLAIM_GRACE_MS: '1000' },
          wait: { worker: true },
        };
      }),
    );
    const leading = await Promise.any(
      nodes.map(async ({ node }, i) => {
        await node.waitForLog((l) => l.msg === 'became leader', 30_000);
        return i;
      }),
    );
    const leader = nodes[leading]!;
    const survivor = nodes[1 - leading]!;
    const call = <T>(method: string, path: string, body?: unknown) =>
      apiCall<T>(survivor.apiUrl, method, path, body);

    const job = await call<JobAnswer>('POST', '/jobs', {
      name: `pg-cut-${uniqueId()}`,
      schedule: '* * * * * *',
      target: { url: `${fixture.target.url}/pg-cut`, method: 'POST' },
      timeoutMs: 1000,
      misfire: 'skip',
    });
    await waitFor('two calls before the cut', () => fixture.target.forJob(job.id).length >= 2, 20_000);

    const cutAt = Date.now();
    proxies[leading]!.cut();
    const steppedDown = await leader.node.waitForLog((l) => l.msg === 'stepped down', 30_000);
    const became = await survivor.node.waitForLog((l) => l.msg === 'became leader', 20_000);
    console.log(
      `# stepped down ${at(steppedDown) - cutAt} ms after the cut (${String(steppedDown.reason)}); ` +
        `the other node led ${at(became) - at(steppedDown)} ms after that`,
    );
    assert.equal(steppedDown.reason, 'database-unreachable');

    // Occurrences well past the runs the cut-off leader had created ahead (5 s), then heal and stop.
    await waitFor(
      'calls of occurrences created by the new leader',
      () =>
        fixture.target.forJob(job.id).filter((c) => Date.parse(c.scheduledFor) > at(became) + 3000).length >=
        2,
      30_000,
    );
    proxies[leading]!.heal();
    const paused = await call<JobAnswer>('POST', `/jobs/${job.id}/pause`);
    await waitFor(
      'every run of the job to end',
      async () => {
        const { rows } = await fixture.db.pool.query<{ n: number }>(
          `SELECT count(*)::int AS n FROM runs WHERE job_id = $1 AND state IN ('queued', 'running')`,
          [job.id],
        );
        return rows[0]!.n === 0;
      },
      60_000,
    );

    const { rows } = await fixture.db.pool.query<{ state: string; at: Date }>(
      `SELECT state, scheduled_for AS at FROM runs WHERE job_id = $1 AND trigger = 'schedule'`,
      [job.id],
    );
    const runs = new Map(rows.map((r) => [r.at.getTime(), r]));
    const calls = fixture.target.forJob(job.id);
    const from = Math.ceil((Date.parse(job.createdAt) + 150) / 1000) * 1000;
    const to = Date.parse(paused.updatedAt) - 150;
    const problems: string[] = [];
    for (let s = from; s <= to; s += 1000) {
      const when = new Date(s).toISOString();
      const run = runs.get(s);
      if (!run) problems.push(`${when}: no run`);
      else if (run.state !== 'succeeded') problems.push(`${when}: ${run.state}`);
      else if (!calls.some((c) => Date.parse(c.scheduledFor) === s)) problems.push(`${when}: never called`);
    }
    assert.deepEqual(
      problems,
      [],
      'every occurrence from the job’s creation to its pause has one run that ran',
    );
  },
);
