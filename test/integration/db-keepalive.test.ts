import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { after, before, test } from 'node:test';
import { pino } from 'pino';
import type pg from 'pg';
import { createPool } from '../../src/store/db.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';

// A pooled connection whose server vanished without a FIN or RST (a failover to another host while
// the network dropped packets) only fails once the OS's keep-alive probes go unanswered. Linux
// starts them after tcp_keepalive_time (two hours by default) unless the socket asks for sooner;
// until then a statement waiting on the connection holds its pool slot. The pool's sockets ask
// for 10 s, as the LISTEN connection's do. What the kernel has armed is read back with `ss`.

let db: TestDatabase;
before(async () => {
  db = await createTestDatabase();
});
after(() => db.drop());

/** Seconds until the keep-alive timer of the TCP connection from local port `port` fires, by `ss`. */
function keepAliveTimerSeconds(port: number): number {
  const out = execFileSync('ss', ['-tnoH', 'state', 'established', `( sport = :${port} )`], {
    encoding: 'utf8',
  });
  const timer = /timer:\(keepalive,([\d.]+)(ms|sec|min)/.exec(out);
  assert.ok(
    timer,
    `a keep-alive timer on the connection from port ${port}: ${out.trim() || '(no such socket)'}`,
  );
  const value = Number(timer[1]);
  return timer[2] === 'ms' ? value / 1000 : timer[2] === 'min' ? value * 60 : value;
}

test("the pool's connections probe a silent server after 10 s, not the OS's two hours", async () => {
  const pool = createPool({
    connectionString: db.url,
    max: 1,
    logger: pino({ level: 'silent' }),
    applicationName: 'test',
  });
  try {
    const client = await pool.connect();
    const port = (client as pg.PoolClient & { connection: { stream: { localPort: number } } }).connection
      .stream.localPort;
    client.release();
    await pool.query('SELECT 1');
    const seconds = keepAliveTimerSeconds(port);
    assert.ok(seconds > 0 && seconds <= 10, `keep-alive probes begin in ${seconds} s (expected at most 10)`);
  } finally {
    await pool.end();
  }
});
