import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import {
  createEverySecondJob,
  firstToLead,
  loggedAt,
  occurrencesNotRun,
  pauseAndSettle,
} from '../support/every-second-job.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { startTogether } from '../support/start-together.js';
import { FaultProxy } from '../support/fault-proxy.js';

// README, "A leader that cannot reach PostgreSQL hands over": a leader cut off from PostgreSQL
// alone keeps its etcd lease, so etcd never replaces it. Its dispatcher commits nothing; after
// HELIOS_LEADER_STALL_MS it probes PostgreSQL on a new connection, and when that fails too it
// steps down, so that the node that can reach the database leads. With the default lookahead
// (5.5 s), misfire threshold (5 s) and stall limit (4 s) no occurrence misfires meanwhile, which a
// misfire `skip` job shows: a missed occurrence would leave no run at all.

let fixture: IntegrationFixture;
/** Each node reaches PostgreSQL through its own proxy, so whichever leads can be cut off alone. */
let proxies: FaultProxy[] = [];

before(async () => {
  fixture = await integrationFixture();
  proxies = await FaultProxy.inFrontOf(fixture.db.url, 2);
});
after(async () => {
  // Healed first, so the cut-off node can stop cleanly.
  for (const proxy of proxies) await proxy.close();
  await fixture.teardown();
});

test(
  'a leader cut off from PostgreSQL alone steps down for the node that can reach it: every occurrence of a misfire "skip" job still runs',
  { timeout: 120_000 },
  async () => {
    const nodes = await startTogether(
      fixture,
      proxies.map((proxy, i) => ({
        name: `pg-cut-${i + 1}`,
        // A run the cut-off node had claimed comes back soon after its grace.
        extra: { HELIOS_DATABASE_URL: proxy.urlFor(fixture.db.url), HELIOS_CLAIM_GRACE_MS: '1000' },
        wait: { worker: true },
      })),
    );
    const leading = await firstToLead(nodes);
    const leader = nodes[leading]!;
    const survivor = nodes[1 - leading]!;
    const job = await createEverySecondJob(survivor.apiUrl, fixture.target, 'pg-cut');
    await waitFor('two calls before the cut', () => fixture.target.forJob(job.id).length >= 2, 20_000);

    const cutAt = Date.now();
    proxies[leading]!.cut('drop');
    const steppedDown = await leader.node.waitForLog((l) => l.msg === 'stepped down', 30_000);
    const became = await survivor.node.waitForLog((l) => l.msg === 'became leader', 20_000);
    console.log(
      `# stepped down ${loggedAt(steppedDown) - cutAt} ms after the cut (${String(steppedDown.reason)}); ` +
        `the other node led ${loggedAt(became) - loggedAt(steppedDown)} ms after that`,
    );
    assert.equal(steppedDown.reason, 'database-unreachable');

    // Occurrences well past the runs the cut-off leader had created ahead (5.5 s), then heal and stop.
    await waitFor(
      'calls of occurrences created by the new leader',
      () =>
        fixture.target.forJob(job.id).filter((c) => Date.parse(c.scheduledFor) > loggedAt(became) + 3000)
          .length >= 2,
      30_000,
    );
    proxies[leading]!.heal({ closeExisting: true });
    const paused = await pauseAndSettle(survivor.apiUrl, fixture.db.pool, job.id);
    assert.deepEqual(
      await occurrencesNotRun(fixture.db.pool, fixture.target, job, paused),
      [],
      'every occurrence from the job’s creation to its pause has one run that ran',
    );
  },
);
