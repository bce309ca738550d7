import assert from 'node:assert/strict';
import { afterEach, beforeEach, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import {
  createEverySecondJob,
  describeLeaderEvents,
  firstToLead,
  leaderEvents,
  stepDownsAsCutOff,
} from '../support/every-second-job.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { startTogether } from '../support/start-together.js';
import { fenceToken, withFenceLocked } from '../support/database.js';

// Review of 2f3694b (stall watch: "sessions lost" when none of the leader pool's sessions is at
// work). Interleaving: PostgreSQL answers every session, the leader's connections are fine, but
// it refuses the leader's writes with an error of its own for a while -- a server switched to
// read-only (storage full on a managed server, a primary being demoted), SQLSTATE 25006. Every
// node meets the same database. The dispatcher's pass fails at once and backs off (≤ 2 s)
// between tries, so no pass commits; between tries the leader pool's sessions are idle, not at
// work, and the probe's new connection is answered. README: a leader "that PostgreSQL answers
// with an error of its own ... stays ... another node would meet the same database". Before
// 2f3694b (probe = "does a new connection answer") it stayed. Here a trigger on the fence row
// makes PostgreSQL answer every fenced write with the read-only error; the nodes' connections
// and every other statement are untouched.

let fixture: IntegrationFixture;

beforeEach(async () => {
  fixture = await integrationFixture();
});
afterEach(async () => {
  await fixture.db.pool
    .query('DROP TRIGGER IF EXISTS review2_read_only ON leader_fence')
    .catch(() => undefined);
  await fixture.teardown();
});

test(
  'PostgreSQL refusing the leader writes with its own error (read-only) for 14 s: no leader steps down as cut off',
  { timeout: 120_000 },
  async () => {
    const nodes = await startTogether(
      fixture,
      [1, 2].map((i) => ({
        name: `ro-${i}`,
        extra: { HELIOS_ROLES: 'scheduler,api' },
        wait: {},
      })),
    );
    await firstToLead(nodes);
    const job = await createEverySecondJob(nodes[0]!.apiUrl, fixture.target, 'ro', { misfire: 'fire-once' });
    const runsOf = async (since: Date) =>
      (
        await fixture.db.pool.query<{ n: number }>(
          'SELECT count(*)::int AS n FROM runs WHERE job_id = $1 AND created_at > $2',
          [job.id, since],
        )
      ).rows[0]!.n;
    await waitFor('runs created before the fault', async () => (await runsOf(new Date(0))) >= 2, 20_000);

    await fixture.db.pool.query(`
      CREATE OR REPLACE FUNCTION review2_read_only() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN
        RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction' USING ERRCODE = '25006';
      END $$`);
    const faultAt = Date.now();
    await fixture.db.pool.query(
      'CREATE TRIGGER review2_read_only BEFORE UPDATE ON leader_fence FOR EACH ROW EXECUTE FUNCTION review2_read_only()',
    );
    await sleep(14_000);
    await fixture.db.pool.query('DROP TRIGGER review2_read_only ON leader_fence');
    const healedAt = Date.now();
    await waitFor(
      'runs created again after the fault',
      async () => (await runsOf(new Date(healedAt))) > 0,
      15_000,
    );
    const recoveredMs = Date.now() - healedAt;

    const events = leaderEvents(nodes, faultAt);
    console.log(
      `# read-only ${healedAt - faultAt} ms, runs again ${recoveredMs} ms after: ${describeLeaderEvents(events)}`,
    );
    assert.deepEqual(
      stepDownsAsCutOff(events),
      [],
      'no leader stepped down as cut off from PostgreSQL while PostgreSQL answered its sessions',
    );
  },
);

// Interleaving: the lock case the README keeps its leader for ("a lock wait included"), on a
// server where track_activities is off (a documented tuning knob: pg_stat_activity then reports
// state 'disabled' for every session, not NULL). The dispatcher waits on the fence row, locked by
// an operator's transaction for 10 s; its session is at work, but its state reads 'disabled'.
test(
  'a dispatcher held by a lock on a server with track_activities off: the leader stays',
  { timeout: 120_000 },
  async () => {
    const { rows } = await fixture.db.pool.query<{ db: string }>('SELECT current_database() AS db');
    await fixture.db.pool.query(`ALTER DATABASE "${rows[0]!.db}" SET track_activities = off`);
    const nodes = await startTogether(
      fixture,
      [1, 2].map((i) => ({ name: `ta-${i}`, extra: { HELIOS_ROLES: 'scheduler,api' }, wait: {} })),
    );
    await firstToLead(nodes);
    await waitFor('the leader to write', async () => (await fenceToken(fixture.db.pool)) !== 0n, 10_000);
    const lockedAt = Date.now();
    await withFenceLocked(fixture.db.pool, () => sleep(10_000));
    await sleep(1000);
    const events = leaderEvents(nodes, lockedAt);
    console.log(`# track_activities off, fence locked 10 s: ${describeLeaderEvents(events)}`);
    assert.deepEqual(
      stepDownsAsCutOff(events),
      [],
      'no leader stepped down as cut off while its dispatcher waited on a lock',
    );
  },
);
