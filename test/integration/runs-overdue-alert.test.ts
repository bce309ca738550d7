import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { createEverySecondJob } from '../support/every-second-job.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { scrapeMetrics } from '../support/metrics.js';

// HeliosRunsOverdueGrowing's input on a real node: with no worker claiming (every worker stopped),
// the leader keeps creating runs and helios_runs_overdue climbs with them, each run counted once it
// is HELIOS_MISFIRE_THRESHOLD_MS overdue; nothing else takes them out of the queue meanwhile.

let f: IntegrationFixture;
before(async () => {
  f = await integrationFixture();
});
after(() => f.teardown());

test(
  'no worker claiming: helios_runs_overdue grows with the runs the leader creates',
  { timeout: 120_000 },
  async () => {
    const { apiUrl } = await f.start(
      'no-workers',
      { HELIOS_ROLES: 'scheduler,api', HELIOS_SIGNALS_INTERVAL_MS: '500' },
      { leader: true },
    );
    await createEverySecondJob(apiUrl, f.target, 'unclaimed');
    const readings: number[] = [];
    for (let i = 0; i < 6; i++) {
      await sleep(3000);
      readings.push((await scrapeMetrics(apiUrl)).value('helios_runs_overdue') ?? -1);
    }
    assert.ok(readings.at(-1)! >= 8, `overdue readings every 3 s: ${readings.join(', ')}`);
    for (let i = 2; i < readings.length; i++)
      assert.ok(readings[i]! > readings[i - 1]!, `overdue readings every 3 s: ${readings.join(', ')}`);
  },
);
