import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { pino } from 'pino';
import type pg from 'pg';
import { createPool, inTransaction, isReadTimeout } from '../../src/store/db.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
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
    assert.equal(pool.totalCount, 0, 'the silent connection left the pool');
    proxy.heal();
    assert.deepEqual((await pool.query<{ one: number }>('SELECT 1 AS one')).rows, [{ one: 1 }]);
  } finally {
    proxy.heal();
    await pool.end();
  }
});
