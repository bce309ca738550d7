import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import pg from 'pg';
import { createPool } from '../../src/store/db.js';
import { endPredecessorSessions, leaderApplicationName } from '../../src/store/leader-sessions.js';
import { silentLogger } from '../../src/observability/logger.js';
import { insertJob, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { nodeEnvironment, spawnFixture, type ManagedProcess } from '../support/processes.js';
import { fenceToken } from '../support/database.js';

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

/** The epoch check of a leader that still leads (these tests call the store function directly). */
const leading = () => true;

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
  const fenced = await fenceToken(fx.db.pool);
  const other = await openTransaction(leaderApplicationName('newer-leader'), 'SELECT 1');
  const pool = new pg.Pool({
    connectionString: fx.db.url,
    max: 1,
    application_name: leaderApplicationName('stale'),
  });
  try {
    assert.deepEqual(await endPredecessorSessions(pool, fenced - 1n, leading), []);
    assert.equal(await other.alive(), true);
    // The same call with a token at the fence does end it: the condition above is what spared it.
    assert.deepEqual(await endPredecessorSessions(pool, fenced, leading), [
      leaderApplicationName('newer-leader'),
    ]);
    assert.equal(await other.alive(), false);
  } finally {
    await other.close();
    await pool.end();
  }
});

// PostgreSQL keeps 63 bytes of an application_name. Node ids may have 64 characters (a default id
// is the host name and the pid, at its end), so two nodes whose ids share their first 49 would
// both be `helios-leader:<the same 49>` and each would take the other's sessions for its own.
test('leaders whose node ids differ only past 63 bytes of application_name are told apart', async () => {
  const shared = 'helios-scheduler-production-eu-west-1-deployment-7d9f8b6c5d';
  const gone = await openTransaction(leaderApplicationName(`${shared}-1`), 'SELECT 1');
  const pool = new pg.Pool({
    connectionString: fx.db.url,
    max: 1,
    application_name: leaderApplicationName(`${shared}-2`),
  });
  try {
    const ended = await endPredecessorSessions(pool, await fenceToken(fx.db.pool), leading);
    assert.equal(await gone.alive(), false, "the other node's session was ended");
    assert.equal(ended?.length, 1);
    // And a leader still never ends its own pool's sessions.
    const own = await openTransaction(leaderApplicationName(`${shared}-2`), 'SELECT 1');
    try {
      assert.deepEqual(await endPredecessorSessions(pool, await fenceToken(fx.db.pool), leading), []);
      assert.equal(await own.alive(), true);
    } finally {
      await own.close();
    }
  } finally {
    await gone.close();
    await pool.end();
  }
});

// An operator may add application_name to HELIOS_DATABASE_URL (for their dashboards); pg lets
// the URL's parameters win over the pool's options, which would hide every leader session from
// the takeover and bring back the wait for PostgreSQL's idle timeout.
test('an application_name in the database URL does not hide a leader pool from the takeover', async () => {
  const url = new URL(fx.db.url);
  url.searchParams.set('application_name', 'ops-dashboard');
  const gonePool = createPool({
    connectionString: url.toString(),
    max: 1,
    logger: silentLogger,
    applicationName: leaderApplicationName('gone-by-url'),
  });
  const pool = new pg.Pool({
    connectionString: fx.db.url,
    max: 1,
    application_name: leaderApplicationName('new-by-url'),
  });
  const client = await gonePool.connect();
  client.on('error', () => undefined); // the session is meant to be ended
  try {
    await client.query('BEGIN');
    const ended = await endPredecessorSessions(pool, await fenceToken(fx.db.pool), leading);
    assert.deepEqual(ended, [leaderApplicationName('gone-by-url')]);
  } finally {
    client.release(true);
    await gonePool.end();
    await pool.end();
  }
});

/** Records the steps a hooked node reports held (from its start: a report may come early). */
function heldSteps(node: ManagedProcess): { until(step: string): Promise<void> } {
  const held = new Set<string>();
  const waiters: (() => void)[] = [];
  node.child.on('message', (message: { pending?: string }) => {
    if (message.pending) held.add(message.pending);
    for (const wake of waiters.splice(0)) wake();
  });
  return {
    async until(step) {
      while (!held.has(step)) await new Promise<void>((resolve) => waiters.push(resolve));
    },
  };
}

// The fence guards the takeover only once the newer leader has committed a write. A leader
// paused right after winning (GC, SIGSTOP) and resumed after a newer one was elected, but before
// that one's first commit, saw a fence at or below its own token and ended the NEW leader's
// open transactions. A stale epoch must end nothing, as it writes nothing.
test("a leader paused right after winning ends none of its successor's sessions on waking", async () => {
  const name = 'takeover-paused';
  const stale = spawnFixture(
    name,
    'test/fixtures/hooked-node.ts',
    nodeEnvironment(name, fx.env({ HELIOS_ROLES: 'scheduler,api', HELIOS_TEST_HOLD: 'takeover' })),
  );
  fx.nodes.push(stale);
  const steps = heldSteps(stale);
  const staleLead = await stale.waitForLog((l) => l.msg === 'became leader');
  await steps.until('takeover');
  stale.signal('SIGSTOP');
  let newer: Awaited<ReturnType<typeof openTransaction>> | undefined;
  try {
    // The paused leader's lease runs out at etcd; a newer leader takes the key (held here, so the
    // paused one cannot win again on waking) and opens its first fenced transaction.
    const key = `${fx.etcdPrefix}/leader`;
    await waitFor(
      "the paused leader's lease to expire",
      async () => (await fx.etcd.get(key).string()) === null,
      10_000,
    );
    const won = await fx.etcd
      .if(key, 'Create', '==', 0)
      .then(fx.etcd.put(key).value(JSON.stringify({ nodeId: 'newer', since: new Date().toISOString() })))
      .commit();
    assert.ok(won.succeeded);
    const newerToken = BigInt(won.header.revision);
    assert.ok(newerToken > BigInt(staleLead.token as string));
    newer = await openTransaction(
      leaderApplicationName('newer'),
      `UPDATE leader_fence SET token = ${newerToken}, node_id = 'newer' WHERE id AND token <= ${newerToken}`,
    );
    assert.ok(
      (await fenceToken(fx.db.pool)) <= BigInt(staleLead.token as string),
      'the newer leader has not committed',
    );

    stale.signal('SIGCONT');
    stale.child.send({ release: 'takeover' });
    const outcome = await stale.waitForLog((l) => l.part === 'takeover', 10_000);
    assert.equal(await newer.alive(), true, "the newer leader's transaction was ended by a stale one");
    assert.notEqual(outcome.msg, "ended an earlier leader's open transactions");
  } finally {
    stale.signal('SIGCONT');
    await newer?.close();
    await stale.stop();
    await fx.etcd.delete().key(`${fx.etcdPrefix}/leader`);
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
