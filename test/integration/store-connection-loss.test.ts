import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { pino } from 'pino';
import { createPool, inTransaction } from '../../src/store/db.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// A PostgreSQL restart ends every session, including one that is checked out of the pool and
// between two statements of a transaction. pg emits 'error' on such a client, and pg-pool listens
// only while the client is idle, so without a listener of our own the process dies of an
// unhandled 'error' event. These tests end the session from another connection at exactly that
// moment; node:test fails a file whose process raises an uncaught exception.

let db: TestDatabase;
before(async () => {
  db = await createTestDatabase();
});
after(async () => {
  await db.drop();
});

function quietPool(url: string) {
  return createPool({
    connectionString: url,
    max: 2,
    logger: pino({ level: 'silent' }),
    applicationName: 'test',
  });
}

test('a session ended between two statements of a transaction fails the transaction, not the process', async () => {
  const pool = quietPool(db.url);
  try {
    const attempt = inTransaction(pool, async (client) => {
      const { rows } = await client.query<{ pid: number }>('SELECT pg_backend_pid() AS pid');
      await db.pool.query('SELECT pg_terminate_backend($1)', [rows[0]!.pid]);
      // Give the socket time to close while no statement is active on it.
      await sleep(300);
      await client.query('SELECT 1');
    });
    await assert.rejects(attempt);
    // The broken client was discarded: the pool still serves queries.
    const { rows } = await pool.query<{ one: number }>('SELECT 1 AS one');
    assert.equal(rows[0]!.one, 1);
  } finally {
    await pool.end();
  }
});

test('a session ended while the work is outside the database rolls back and reports the loss', async () => {
  const pool = quietPool(db.url);
  try {
    await db.pool.query('CREATE TABLE IF NOT EXISTS connection_loss_probe (n int)');
    const attempt = inTransaction(pool, async (client) => {
      await client.query('INSERT INTO connection_loss_probe VALUES (1)');
      const { rows } = await client.query<{ pid: number }>('SELECT pg_backend_pid() AS pid');
      await db.pool.query('SELECT pg_terminate_backend($1)', [rows[0]!.pid]);
      await sleep(300);
      // The work finishes without another statement; COMMIT must still fail.
    });
    await assert.rejects(attempt);
    const { rows } = await db.pool.query<{ count: string }>('SELECT count(*) FROM connection_loss_probe');
    assert.equal(rows[0]!.count, '0');
  } finally {
    await pool.end();
  }
});
