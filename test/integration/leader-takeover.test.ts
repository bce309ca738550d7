import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import pg from 'pg';
import { endPredecessorSessions, leaderApplicationName } from '../../src/store/leader-sessions.js';
import { insertJob, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';

// A leader cut off inside its transaction (partitioned away, paused) leaves that transaction open
// in PostgreSQL, holding the fence row and the jobs it locked, until PostgreSQL ends it. Its
// successor must not wait for that: an occurrence held up to the idle transaction timeout (5 s,
// the misfire threshold) was found late and skipped (chaos seed 5).

let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture();
});
after(async () => {
  await fx.teardown();
});

/** A session inside an open transaction that never times out on its own, as a cut-off leader's is. */
async function openTransaction(applicationName: string, ...statements: string[]) {
  const client = new pg.Client({
    connectionString: fx.db.url,
    application_name: applicationName,
    options: '-c idle_in_transaction_session_timeout=0 -c statement_timeout=0',
  });
  const errors: Error[] = [];
  client.on('error', (err) => errors.push(err));
  await client.connect();
  await client.query('BEGIN');
  for (const statement of statements) await client.query(statement);
  return {
    /** True while the session still answers. */
    async alive(): Promise<boolean> {
      try {
        await client.query('SELECT 1');
        return true;
      } catch {
        return false;
      }
    },
    errors,
    close: () => client.end().catch(() => undefined),
  };
}

// Runs before any node of this file starts: its leader pool's sessions would be ended too.
test('a leader whose token is below the fence (a newer leader wrote) ends no session', async () => {
  const { rows } = await fx.db.pool.query<{ token: string }>('SELECT token::text AS token FROM leader_fence');
  const fenced = BigInt(rows[0]!.token);
  const other = await openTransaction(leaderApplicationName('newer-leader'), 'SELECT 1');
  const pool = new pg.Pool({
    connectionString: fx.db.url,
    max: 1,
    application_name: leaderApplicationName('stale'),
  });
  try {
    assert.deepEqual(await endPredecessorSessions(pool, fenced - 1n), []);
    assert.equal(await other.alive(), true);
    // The same call with a token at the fence does end it: the condition above is what spared it.
    assert.deepEqual(await endPredecessorSessions(pool, fenced), [leaderApplicationName('newer-leader')]);
    assert.equal(await other.alive(), false);
  } finally {
    await other.close();
    await pool.end();
  }
});

test("a new leader ends its predecessor's open transaction and dispatches at once", async () => {
  const jobId = await insertJob(fx.db.pool, {
    name: 'held-by-a-gone-leader',
    schedule: '* * * * * *',
    target: { url: `${fx.target.url}/takeover` },
    nextRunAt: new Date(Date.now() + 1000),
  });
  // The gone leader: it raised the fence and locked the job, then was cut off.
  const gone = await openTransaction(
    leaderApplicationName('gone-leader'),
    'UPDATE leader_fence SET updated_at = now() WHERE id',
    'SELECT id FROM jobs FOR UPDATE',
  );
  // Another session in a transaction, not a leader pool's: it must be left alone.
  const bystander = await openTransaction('helios-bystander', 'SELECT count(*) FROM jobs');
  try {
    const { node } = await fx.start('takeover-1', { HELIOS_ROLES: 'scheduler,worker,api' });
    // Without the takeover the dispatcher's first fenced transaction waits on the fence row for
    // the statement timeout (30 s): nothing would arrive within this wait.
    await waitFor('the first occurrence to arrive', () => fx.target.forJob(jobId).length > 0, 10_000);
    assert.equal(await gone.alive(), false, "the gone leader's session was ended");
    assert.equal(await bystander.alive(), true, 'a session of no leader pool is left alone');
    const ended = node.logs.find((l) => l.msg === "ended an earlier leader's open transactions");
    assert.deepEqual(ended?.sessions, [leaderApplicationName('gone-leader')]);
  } finally {
    await gone.close();
    await bystander.close();
  }
});
