import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { CronSchedule } from '../../src/scheduling/cron.js';
import { Dispatcher, type DispatcherOptions } from '../../src/scheduling/dispatcher.js';

// The dispatcher's cache of parsed schedules alone (its passes are tested against PostgreSQL in
// test/integration/). A parsed schedule holds croner's 10,000-entry year table (≈83 KB), and a
// leader that leads for months meets every schedule its users ever gave a job.

type Job = { schedule: string; timezone: string };

function cacheOf(dispatcher: Dispatcher) {
  const inside = dispatcher as unknown as {
    schedule(job: Job): CronSchedule;
    schedules: Map<string, unknown>;
  };
  return { parse: (job: Job) => inside.schedule(job), size: () => inside.schedules.size };
}

test('the leader keeps a bounded number of parsed schedules however many distinct ones its jobs had', () => {
  const cache = cacheOf(new Dispatcher({} as DispatcherOptions));
  const every = { schedule: '* * * * * *', timezone: 'UTC' };
  const kept = cache.parse(every);
  // 2,000 jobs created, dispatched and deleted, each with a schedule of its own, while an
  // every-second job stays due at every pass.
  for (let n = 0; n < 2000; n++) {
    cache.parse({ schedule: `${n % 60} ${Math.floor(n / 60) % 60} * * * *`, timezone: 'UTC' });
    assert.equal(cache.parse(every), kept, 'a schedule in use stays parsed');
  }
  assert.ok(cache.size() <= 256, `${cache.size()} parsed schedules kept (≈83 KB each)`);
});
