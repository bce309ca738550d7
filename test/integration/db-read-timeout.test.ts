import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { pino } from 'pino';
import type pg from 'pg';
import { createPool, inTransaction, isReadTimeout, withClient } from '../../src/store/db.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { PoolShare } from '../../src/store/pool-share.js';
import { FaultProxy } from '../support/fault-proxy.js';
import { TcpProxy } from '../support/tcp-proxy.js';

// A statement whose answer cannot come (the server gone without a word, a proxy that stopped
// forwarding: the kernel still acknowledges every byte, so neither keep-alive probes nor TCP
// retransmissions ever fail the connection) must not hold its caller and its pool slot forever.
// The pool gives up waiting after its query_timeout (35 s; shortened here) and discards the
// connection, which node-postgres leaves unable to send another statement.

const TIMEOUT_MS = 300;

let db: TestDatabase;
let proxy: TcpProxy;
before(async () => {
  db = await createTestDatabase();
  const url = new URL(db.url);
  proxy = new TcpProxy(url.hostname, Number(url.port || 5432));
  await proxy.listen();
});
after(async () => {
  await proxy.close();
  await db.drop();
});

/**
 * Resolves once `inUse` (checked-out clients, slots of a share) is 0, 2 s at most: a client whose
 * read timed out is given back, discarded, once its statement is cancelled in PostgreSQL
 * (cancelStatement, 1 s at most), while its caller goes on.
 */
async function givenBack(inUse: () => number): Promise<void> {
  for (const began = Date.now(); inUse() > 0 && Date.now() - began < 2000;) await sleep(5);
}

function poolThroughProxy(): pg.Pool {
  const url = new URL(db.url);
  url.hostname = '127.0.0.1';
  url.port = String(proxy.port);
  return createPool({
    connectionString: url.toString(),
    max: 2,
    logger: pino({ level: 'silent' }),
    applicationName: 'read-timeout-test',
    queryTimeoutMs: TIMEOUT_MS,
  });
}

test('a statement on a connection gone silent fails with a read timeout, and the pool discards the connection', async () => {
  const pool = poolThroughProxy();
  try {
    await pool.query('SELECT 1');
    assert.equal(pool.totalCount, 1);
    proxy.cut();
    await assert.rejects(pool.query('SELECT 1'), (err) => isReadTimeout(err));
    assert.equal(pool.totalCount, 0, 'the silent connection left the pool');
  } finally {
    proxy.heal();
    await pool.end();
  }
});

test('inside a transaction: the read timeout fails it without a ROLLBACK that could never be sent, and the connection is discarded', async () => {
  const pool = poolThroughProxy();
  try {
    await pool.query('SELECT 1');
    const sent: string[] = [];
    const attempt = inTransaction(pool, async (client) => {
      const query = client.query.bind(client) as (text: string) => Promise<unknown>;
      (client as { query: unknown }).query = (text: string) => {
        sent.push(text);
        return query(text);
      };
      proxy.cut();
      await client.query('SELECT 1');
    });
    await assert.rejects(attempt, (err) => isReadTimeout(err));
    assert.deepEqual(sent, ['SELECT 1'], 'no ROLLBACK queued behind the statement that never answered');
    await givenBack(() => pool.totalCount);
    assert.equal(pool.totalCount, 0, 'the silent connection left the pool');
    proxy.heal();
    assert.deepEqual((await pool.query<{ one: number }>('SELECT 1 AS one')).rows, [{ one: 1 }]);
  } finally {
    proxy.heal();
    await pool.end();
  }
});

test('a checkout given its own read timeout: its statements wait that long at most, and the client goes back to the pool without it', async () => {
  const url = new URL(db.url);
  url.hostname = '127.0.0.1';
  url.port = String(proxy.port);
  // The pool's own read timeout is far longer: only the checkout's applies.
  const pool = createPool({
    connectionString: url.toString(),
    max: 1,
    logger: pino({ level: 'silent' }),
    applicationName: 'read-timeout-test',
    queryTimeoutMs: 30_000,
  });
  const bounded = { readTimeoutMs: TIMEOUT_MS };
  try {
    // Every statement of the checkout is bounded, BEGIN and COMMIT included, and a statement
    // slower than the bound fails even on a healthy connection.
    const sent: string[] = [];
    await assert.rejects(
      inTransaction(
        pool,
        async (client) => {
          sent.push('work');
          await client.query('SELECT pg_sleep(1)');
        },
        bounded,
      ),
      (err) => isReadTimeout(err),
    );
    assert.deepEqual(sent, ['work']);
    await givenBack(() => pool.totalCount);
    assert.equal(pool.totalCount, 0, 'the connection whose read timed out left the pool');

    // A bounded checkout that succeeds gives its client back unbounded: the next checkout of the
    // same connection waits for a statement slower than the bound.
    await withClient(pool, (client) => client.query('SELECT 1'), undefined, bounded);
    assert.equal(pool.totalCount, 1);
    const { rows } = await withClient(pool, (client) =>
      client.query<{ slept: string }>(`SELECT pg_sleep(0.6)::text AS slept`),
    );
    assert.deepEqual(rows, [{ slept: '' }]);

    // A connection gone silent: the checkout gives up after its bound, not the pool's 30 s.
    proxy.cut();
    const began = Date.now();
    await assert.rejects(
      inTransaction(pool, (client) => client.query('SELECT 1'), bounded),
      (err) => isReadTimeout(err),
    );
    const waited = Date.now() - began;
    assert.ok(waited < 5_000, `gave up after ${waited} ms, not the pool's 30 s`);
    await givenBack(() => pool.totalCount);
    assert.equal(pool.totalCount, 0, 'the silent connection left the pool');
  } finally {
    proxy.heal();
    await pool.end();
  }
});

test('a statement whose answer is given up on is cancelled in PostgreSQL before its slot is freed, through the worker share too', async () => {
  // Given up on while it waits for a lock, the statement went on waiting in PostgreSQL after its
  // connection was discarded, and the caller's retry took another session: past the worker's
  // share (worker-share-blocked), toward max_connections.
  const applicationName = 'read-timeout-cancel-test';
  const pool = createPool({
    connectionString: db.url,
    max: 2,
    logger: pino({ level: 'silent' }),
    applicationName,
    queryTimeoutMs: 30_000,
  });
  const share = new PoolShare(pool, 1);
  const locker = await db.pool.connect();
  const waitingForTheLock = async () =>
    (
      await db.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1 AND wait_event_type = 'Lock'`,
        [applicationName],
      )
    ).rows[0]!.n;
  try {
    await db.pool.query('CREATE TABLE read_timeout_locked (n int)');
    await locker.query('BEGIN');
    await locker.query('LOCK TABLE read_timeout_locked IN ACCESS EXCLUSIVE MODE');
    await assert.rejects(
      withClient(pool, (client) => client.query('SELECT n FROM read_timeout_locked'), undefined, {
        readTimeoutMs: TIMEOUT_MS,
      }),
      (err) => isReadTimeout(err),
    );
    await givenBack(() => pool.totalCount - pool.idleCount);
    assert.equal(
      await waitingForTheLock(),
      0,
      'the checkout statement given up on still waits in PostgreSQL',
    );
    const timed: pg.QueryConfig & { query_timeout: number } = {
      text: 'SELECT n FROM read_timeout_locked',
      query_timeout: TIMEOUT_MS,
    };
    await assert.rejects(share.query(timed), (err) => isReadTimeout(err));
    await givenBack(() => share.inUse);
    assert.equal(await waitingForTheLock(), 0, "the share's statement given up on still waits in PostgreSQL");
  } finally {
    await locker.query('ROLLBACK').catch(() => undefined);
    locker.release();
    await pool.end();
  }
});

/**
 * Most sessions of a share of one waiting for a lock at once, while a statement of the share
 * waiting for it is given up on and tried again, new connections to the database meeting
 * `fault` (set on a proxy in front of it) from the first try on.
 */
async function sessionsBesideTheRetry(name: string, fault: (proxy: FaultProxy) => void): Promise<number> {
  const applicationName = `read-timeout-${name}`;
  const table = `read_timeout_${name.replaceAll('-', '_')}`;
  const [proxy] = (await FaultProxy.inFrontOf(db.url, 1)) as [FaultProxy];
  const pool = createPool({
    connectionString: proxy.urlFor(db.url),
    max: 3,
    logger: pino({ level: 'silent' }),
    applicationName,
    queryTimeoutMs: 30_000,
  });
  const share = new PoolShare(pool, 1);
  const locker = await db.pool.connect();
  const timed: pg.QueryConfig & { query_timeout: number } = {
    text: `SELECT n FROM ${table}`,
    query_timeout: TIMEOUT_MS,
  };
  try {
    // Idle connections of the pool, for the retry.
    await Promise.all([pool.query('SELECT pg_sleep(0.05)'), pool.query('SELECT pg_sleep(0.05)')]);
    await db.pool.query(`CREATE TABLE ${table} (n int)`);
    await locker.query('BEGIN');
    await locker.query(`LOCK TABLE ${table} IN ACCESS EXCLUSIVE MODE`);
    fault(proxy);
    await assert.rejects(share.query(timed), (err) => isReadTimeout(err));
    const retry = share.query(timed).catch((err: unknown) => err);
    let most = 0;
    for (let settled = false; !settled;) {
      const { rows } = await db.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1 AND wait_event_type = 'Lock'`,
        [applicationName],
      );
      most = Math.max(most, rows[0]!.n);
      settled = await Promise.race([retry.then(() => true), sleep(20).then(() => false)]);
    }
    assert.ok(isReadTimeout(await retry));
    return most;
  } finally {
    await locker.query('ROLLBACK').catch(() => undefined);
    locker.release();
    proxy.refuseNew = undefined;
    await pool.end();
    await proxy.close();
  }
}

test("a share's statement given up on while new connections are slow to open: its retry does not wait for the lock beside it", async () => {
  // The cancel goes on a connection of its own, which a database slow to take new sessions (the
  // very lock may be why) answers late: past the cancel's wait (1 s) the slot was freed, and the
  // retry, on an idle connection of the pool, waited for the lock beside the statement still
  // waiting there: two sessions of a share of one.
  const most = await sessionsBesideTheRetry('slow-cancel', (proxy) => (proxy.newConnectionDelayMs = 1500));
  assert.equal(most, 1, `${most} sessions of a share of 1 waited for the lock at once`);
});

test("a share's statement given up on while new connections are refused for a moment: its retry does not wait for the lock beside it", async () => {
  // A cancel refused (a pooler at its client limit answers every new connection so) counted as
  // taken: the slot was freed, and the retry waited for the lock beside the statement.
  const most = await sessionsBesideTheRetry('refused-cancel', (proxy) => {
    proxy.refuseNew = { code: '53300', message: 'sorry, too many clients already' };
    setTimeout(() => (proxy.refuseNew = undefined), TIMEOUT_MS + 1000);
  });
  assert.equal(most, 1, `${most} sessions of a share of 1 waited for the lock at once`);
});
