import assert from 'node:assert/strict';
import { getEventListeners } from 'node:events';
import { createServer, type Socket } from 'node:net';
import type { AddressInfo } from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { pino } from 'pino';
import { Notifications } from '../../src/store/notifications.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { waitFor } from '../support/execution.js';

// The LISTEN connection of src/store/notifications.ts against the real PostgreSQL: it must survive
// any number of reconnects without leaking, and never hang on a server that does not answer.

let db: TestDatabase;
const quiet = pino({ level: 'silent' });

before(async () => {
  db = await createTestDatabase();
});
after(async () => {
  await db.drop();
});

/** Backend pids of this database's LISTEN sessions. */
async function listenPids(): Promise<number[]> {
  const { rows } = await db.pool.query<{ pid: number }>(
    `SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = 'helios-listen'`,
    [db.name],
  );
  return rows.map((r) => r.pid);
}

/** The loop's own abort signal (private): the one that listeners must not pile up on. */
function loopSignal(notifications: Notifications): AbortSignal {
  return (notifications as unknown as { abort: AbortController }).abort.signal;
}

test('reconnecting the LISTEN connection many times adds no listener per reconnect, and notifications still arrive', async () => {
  const notifications = new Notifications(db.url, ['helios_jobs'], quiet, { retryDelayMs: 50 });
  notifications.start();
  try {
    let pid = 0;
    const RECONNECTS = 12;
    for (let i = 0; i <= RECONNECTS; i++) {
      await waitFor(
        'a new LISTEN session',
        async () => {
          const pids = await listenPids();
          return pids.length === 1 && pids[0] !== pid;
        },
        10_000,
        20,
      );
      pid = (await listenPids())[0]!;
      // The session is listed before the LISTENs ran; a notification proves it is listening.
      await waitFor(
        'the LISTEN to take effect',
        async () => {
          const woken = notifications.wait('helios_jobs', 200, new AbortController().signal);
          await db.pool.query(`NOTIFY helios_jobs`);
          const start = performance.now();
          await woken;
          return performance.now() - start < 150;
        },
        10_000,
        0,
      );
      if (i < RECONNECTS) await db.pool.query('SELECT pg_terminate_backend($1)', [pid]);
    }
    assert.ok(
      getEventListeners(loopSignal(notifications), 'abort').length <= 1,
      `abort listeners after ${RECONNECTS} reconnects: ${getEventListeners(loopSignal(notifications), 'abort').length}`,
    );
  } finally {
    await notifications.stop();
  }
});

test('a server that accepts and never answers: connecting times out and is retried, and stop() returns at once', async () => {
  // A black hole at the application level: TCP connects, PostgreSQL's startup reply never comes.
  const sockets = new Set<Socket>();
  let accepted = 0;
  const server = createServer((socket) => {
    accepted += 1;
    sockets.add(socket);
    socket.on('error', () => undefined).on('close', () => sockets.delete(socket));
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const port = (server.address() as AddressInfo).port;
  const notifications = new Notifications(
    `postgres://postgres@127.0.0.1:${port}/helios`,
    ['helios_jobs'],
    quiet,
    {
      connectTimeoutMs: 300,
      retryDelayMs: 50,
    },
  );
  try {
    notifications.start();
    await waitFor('a second connection attempt', async () => accepted >= 2, 5000, 20);
    // The connection attempt in progress is abandoned, not awaited.
    await sleep(100);
    const start = performance.now();
    await notifications.stop();
    assert.ok(performance.now() - start < 1500, `stop() took ${Math.round(performance.now() - start)} ms`);
  } finally {
    await Promise.race([notifications.stop(), sleep(2000)]);
    for (const socket of sockets) socket.destroy();
    await new Promise<void>((resolve) => server.close(() => resolve()));
  }
});

test('a notification that comes before the wait begins, after the loop read seen(), ends the wait at once', async () => {
  const notifications = new Notifications(db.url, ['helios_jobs'], quiet);
  notifications.start();
  try {
    const never = new AbortController().signal;
    await waitFor('listening', async () => {
      const woken = notifications.wait('helios_jobs', 200, never).then(() => true);
      await db.pool.query(`NOTIFY helios_jobs`);
      return woken;
    });
    const seen = notifications.seen('helios_jobs');
    // The loop looks at the database; meanwhile a change commits and its notification arrives.
    await db.pool.query(`NOTIFY helios_jobs`);
    await waitFor('the notification', () => notifications.seen('helios_jobs') > seen);
    let started = performance.now();
    await notifications.wait('helios_jobs', 2000, never, seen);
    assert.ok(performance.now() - started < 100, 'the wait since an earlier reading returns at once');
    // Without a notification since the reading, it sleeps.
    started = performance.now();
    await notifications.wait('helios_jobs', 300, never, notifications.seen('helios_jobs'));
    assert.ok(performance.now() - started >= 290, 'no notification since: the wait sleeps');
  } finally {
    await notifications.stop();
  }
});
