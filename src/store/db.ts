import { connect as connectSocket } from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import type { Logger } from '../observability/logger.js';
import { toError } from '../errors.js';
import type { Connections } from './pool-share.js';

/** The node's connection pool, as the layers above store/ see it (they never import pg). */
export type Database = pg.Pool;

/** One connection checked out of the pool, inside a transaction (inTransaction). */
export type DbClient = pg.PoolClient;

/** Anything that can run a query: the pool or a client inside a transaction. */
export type Queryable = Pick<pg.Pool, 'query'> | pg.PoolClient;

// timestamptz arrives as Date (pg default); bigint (int8) as a string is turned into bigint where used.

/**
 * True when an error says the database could not be reached or used at all (no connection, the
 * pool's checkout timed out, the session ended, the server is shutting down or out of resources)
 * rather than that it refused this statement's data (a constraint, a trigger, a bad value).
 * PostgreSQL's own errors carry a five-character SQLSTATE; connection failures carry none, or a
 * system code like ECONNREFUSED.
 */
export function isDatabaseUnavailable(err: unknown): boolean {
  if (!isServerError(err)) return true;
  // 08 connection exception, 53 insufficient resources, 57 operator intervention, 58 system error.
  return /^(08|53|57|58)/.test(err.code);
}

/**
 * True when PostgreSQL itself sent the error (it carries a five-character SQLSTATE): the server
 * answered on that connection, whatever it refused. Errors of the client or the network (a
 * timeout, a reset, the pool's checkout) carry none.
 */
export function isServerError(err: unknown): err is { code: string } {
  const code = (err as { code?: unknown } | null)?.code;
  // Every SQLSTATE has a digit; a system code of five letters (EPIPE) is not one.
  return typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code) && /\d/.test(code);
}

/** System error codes of a connection to PostgreSQL that could not be made or was lost. */
const NETWORK_CODES = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'ETIMEDOUT',
  'EPIPE',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ENOTFOUND',
  'EAI_AGAIN',
]);

/**
 * Narrower than isDatabaseUnavailable, for errors whose origin is unknown (an API request's):
 * true only when PostgreSQL said so (SQLSTATE classes 08, 53, 57, 58: a statement cancelled by
 * its statement_timeout is 57014) or the error is one node-postgres raises for a connection that
 * could not be made, was lost or did not answer; never for a bug of ours (a TypeError).
 */
export function isDatabaseOutage(err: unknown): boolean {
  if (isServerError(err)) return /^(08|53|57|58)/.test(err.code);
  if (!(err instanceof Error)) return false;
  const code = (err as { code?: unknown }).code;
  if (typeof code === 'string' && NETWORK_CODES.has(code)) return true;
  return (
    isReadTimeout(err) ||
    /^(Connection terminated|timeout exceeded when trying to connect|Client has encountered a connection error)/.test(
      err.message,
    )
  );
}

/** How long a pooled client waits for a statement's answer; 5 s past the server's statement_timeout. */
export const QUERY_READ_TIMEOUT_MS = 35_000;

/**
 * True for node-postgres's own "Query read timeout" (query_timeout). The statement may still be
 * on the wire and the connection cannot be used again: pg-pool discards a client released with
 * an error, and inTransaction does so without trying a ROLLBACK that could never be sent.
 */
export function isReadTimeout(err: unknown): boolean {
  return err instanceof Error && err.message === 'Query read timeout';
}

/**
 * `config` waiting `readTimeoutMs` at most for its answer (node-postgres's per-statement
 * query_timeout, which its types leave out); undefined: the pool's read timeout.
 */
export function withReadTimeout(config: pg.QueryConfig, readTimeoutMs: number | undefined): pg.QueryConfig {
  if (readTimeoutMs === undefined) return config;
  const timed: pg.QueryConfig & { query_timeout: number } = { ...config, query_timeout: readTimeoutMs };
  return timed;
}

/** How long the pool waits for a new connection (and cancelStatement for its cancel's). */
const CONNECT_TIMEOUT_MS = 5000;

/** Names the session (the pool's applicationName). $1 = the name. */
const SET_APPLICATION_NAME = `SELECT set_config('application_name', $1, false)`;

/**
 * Opens the node's pool. Errors on idle clients are logged, not thrown (they would crash the process).
 *
 * The session is named again once connected: pg lets an application_name in the connection
 * string win over the pool's option, and the leader takeover finds the leader pools of other
 * nodes by name (store/leader-sessions.ts); renamed by the URL, they would be left to the idle
 * transaction timeout.
 */
export function createPool(options: {
  connectionString: string;
  max: number;
  logger: Logger;
  applicationName: string;
  /** How long a statement's answer is waited for; default 35 s (tests shorten it). */
  queryTimeoutMs?: number;
}): pg.Pool {
  const pool = new pg.Pool({
    connectionString: options.connectionString,
    max: options.max,
    application_name: options.applicationName,
    connectionTimeoutMillis: CONNECT_TIMEOUT_MS,
    idleTimeoutMillis: 30_000,
    // A statement that hangs (a lock we did not expect, a server in trouble) must not hang a loop forever.
    statement_timeout: 30_000,
    // …and one whose answer cannot come (its server gone without a word, a proxy that stopped
    // forwarding) must not either: past this the client gives up waiting and the connection is
    // discarded (see isReadTimeout). Longer than statement_timeout, so that a statement the server
    // runs to its limit still ends with the server's own error.
    query_timeout: options.queryTimeoutMs ?? QUERY_READ_TIMEOUT_MS,
    // A paused process (GC, SIGSTOP) holding row locks inside a transaction must not block the
    // cluster: PostgreSQL ends its session and the locks are released.
    idle_in_transaction_session_timeout: 5_000,
    // A connection whose server is gone without a word (a failover to another host while packets
    // were dropped, a crashed machine) is noticed by the OS's probes 10 s after it fell silent,
    // not after its default of two hours: until then a statement waiting on it holds its slot of
    // the pool (and of the worker's share) and its caller. The LISTEN connection does the same.
    keepAlive: true,
    keepAliveInitialDelayMillis: 10_000,
    // One clock and one zone for every timestamp we format in SQL.
    options: '-c TimeZone=UTC',
    onConnect: async (client) => {
      await client.query(SET_APPLICATION_NAME, [options.applicationName]);
    },
  });
  pool.on('error', (err) => options.logger.warn({ err }, 'idle PostgreSQL client failed'));
  return pool;
}

/**
 * True when PostgreSQL cancelled the statement (SQLSTATE 57014): its statement_timeout, or a
 * cancel request (pg_cancel_backend). The message, which would tell them apart, may be translated.
 */
export function isStatementCancelled(err: unknown): boolean {
  return isServerError(err) && err.code === '57014';
}

/**
 * Runs `work` on one client checked out of `pool` (its statements in order, each sent once the one
 * before has ended, its transaction too), then gives the client back.
 *
 * While the client is checked out, pg-pool no longer listens for its 'error' event, and pg emits
 * one when the session ends between statements (a server restart, pg_terminate_backend, the idle
 * transaction timeout). Unheard, that event would end the process, so we listen for the whole
 * checkout (`work` reads it with `lost()`) and have the pool discard a client that emitted one.
 * When `work` throws, the client goes back to the pool only if `reusable(client, err)` says so
 * (default: never).
 */
export async function withClient<T>(
  pool: Connections,
  work: (client: pg.PoolClient, lost: () => Error | undefined) => Promise<T>,
  reusable: (client: pg.PoolClient, err: unknown) => Promise<boolean> = async () => false,
  options: CheckoutOptions = {},
): Promise<T> {
  const client = await pool.connect();
  let connectionError: Error | undefined;
  const onConnectionError = (err: Error) => {
    connectionError ??= err;
  };
  client.on('error', onConnectionError);
  const unbound = options.readTimeoutMs === undefined ? undefined : boundReads(client, options.readTimeoutMs);
  let broken = false;
  let cancelling: Promise<void> | undefined;
  try {
    return await work(client, () => connectionError);
  } catch (err) {
    broken = connectionError !== undefined || !(await reusable(client, err));
    // Cancelled before the client is discarded and its slot (of the pool, of the share) freed; the
    // caller goes on meanwhile, its retry on another slot (see cancelStatement).
    if (isReadTimeout(err))
      cancelling = cancelStatement(client).then(() => statementEnded(client, STATEMENT_END_WAIT_MS));
    throw toError(err);
  } finally {
    unbound?.();
    const giveBack = () => {
      broken ||= connectionError !== undefined;
      client.release(broken);
      client.removeListener('error', onConnectionError);
    };
    if (cancelling) void cancelling.then(giveBack);
    else giveBack();
  }
}

/**
 * How long cancelStatement waits for PostgreSQL to take its cancel request: as long as the pool
 * waits for a new connection. No caller waits for it (withClient), only the slot of the client
 * given up on; 1 s was shorter than a database slow to take new sessions (the very lock the
 * statement waited for may be why) takes: the slot was freed while the statement still waited
 * in PostgreSQL, and the caller's retry waited beside it, past the worker's share.
 */
const CANCEL_WAIT_MS = CONNECT_TIMEOUT_MS;

/** How long withClient waits, once a cancel is taken, for the session to end its statement. */
const STATEMENT_END_WAIT_MS = 250;

/**
 * Resolves once `client`'s session has answered the statement given up on (its ReadyForQuery:
 * ended, cancelled or not; pg then emits 'drain'), once its connection has ended, or after `ms`.
 * PostgreSQL takes a cancel by signalling the session, which ends its statement only when next
 * scheduled: on a loaded host, the slot freed when the cancel was taken let the retry wait for
 * the lock beside the statement still waiting there. A connection gone silent never answers.
 */
function statementEnded(client: pg.PoolClient, ms: number): Promise<void> {
  if ((client as unknown as { readyForQuery: boolean }).readyForQuery) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      client.removeListener('drain', done).removeListener('end', done).removeListener('error', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    client.once('drain', done).once('end', done).once('error', done);
  });
}

/** A pg client's session, as PostgreSQL named it when it connected (pg keeps it, untyped). */
interface SessionKey {
  readonly processID: number | null;
  readonly secretKey: number | null;
  readonly host: string;
  readonly port: number;
}

/**
 * Asks PostgreSQL to cancel the statement `client`'s session is running, whose answer was given
 * up on (isReadTimeout), and waits until the server has taken the request, CANCEL_WAIT_MS at most,
 * asking again while it is refused (requestCancel); never throws. The request goes on a
 * connection of its own (the protocol's CancelRequest: the session's own connection is the one
 * not answering), which the server closes once it has signalled the session. Left alone, the
 * statement goes on in PostgreSQL after its client is discarded (the server notices a client gone
 * only when it next reads or writes): one waiting for a lock kept its session waiting there while
 * the caller's retry opened another, past the worker's share (worker-share-blocked) and toward
 * max_connections. withClient keeps the client, and so its
 * slot of the pool and of the share, until this has ended, but not its caller: a caller that
 * waited for it tried again as much later as this request's own new connection took, past the
 * claim of a settle write (settle-silent-connection). A session that ended the statement
 * meanwhile ignores the request; so does one that is idle in its transaction, which ends when the
 * discarded connection closes, or by idle_in_transaction_session_timeout.
 */
export async function cancelStatement(client: pg.PoolClient): Promise<void> {
  const { processID, secretKey, host, port } = client as unknown as SessionKey;
  if (processID === null || secretKey === null) return;
  const giveUpAt = performance.now() + CANCEL_WAIT_MS;
  while ((await requestCancel(host, port, processID, secretKey, giveUpAt)) === 'refused') {
    if (giveUpAt - performance.now() <= CANCEL_RETRY_MS) return;
    await sleep(CANCEL_RETRY_MS);
  }
}

/** How long cancelStatement waits before it asks again after a refusal. */
const CANCEL_RETRY_MS = 100;

/**
 * One CancelRequest (length 16, the code 80877102, the session's process id and secret key), on a
 * connection of its own: `taken` once the server has closed it without a word, as PostgreSQL does
 * once it has signalled the session; `refused` when an answer came instead (a connection refused
 * after it was opened: a pooler at its client limit, a server out of slots); `failed` when the
 * connection failed or did not close by `giveUpAt` (performance.now()).
 */
function requestCancel(
  host: string,
  port: number,
  processID: number,
  secretKey: number,
  giveUpAt: number,
): Promise<'taken' | 'refused' | 'failed'> {
  return new Promise((resolve) => {
    const socket = host.startsWith('/')
      ? connectSocket(`${host}/.s.PGSQL.${port}`)
      : connectSocket({ host, port, noDelay: true });
    let answered = false;
    const done = (how: 'taken' | 'failed') => {
      clearTimeout(timer);
      socket.destroy();
      resolve(answered ? 'refused' : how);
    };
    const timer = setTimeout(() => done('failed'), Math.max(0, giveUpAt - performance.now()));
    socket.once('connect', () => {
      const request = Buffer.alloc(16);
      request.writeInt32BE(16, 0);
      request.writeInt32BE(80877102, 4);
      request.writeInt32BE(processID, 8);
      request.writeInt32BE(secretKey, 12);
      socket.end(request);
    });
    socket.on('data', () => (answered = true));
    socket.once('close', () => done('taken'));
    socket.once('error', () => done('failed'));
  });
}

/** How a checkout's statements are sent (withClient, inTransaction). */
export interface CheckoutOptions {
  /**
   * Each statement's answer is waited for this long at most, not the pool's query_timeout (35 s),
   * but for a statement given its own query_timeout (inTransaction's COMMIT):
   * for work whose answer is worth nothing later (a poll whose claims would come back too late to
   * call, a clock sample). Past it the statement fails with a read timeout, is cancelled in
   * PostgreSQL (cancelStatement) and the connection is discarded (isReadTimeout). Such a wait is what a connection that went silent (a NAT or firewall
   * that lost its state, a database moved behind the same address) gives every statement sent on
   * it; the pool hands such a connection out as any other until a statement on it times out.
   */
  readonly readTimeoutMs?: number;
  /**
   * inTransaction's COMMIT too waits `readTimeoutMs` at most: for writes conditional on what they
   * change (a settle write on its claim), whose retry writes nothing when a COMMIT not waited for
   * committed after all. A burial whose connection went silent before its COMMIT waited the
   * pool's 35 s, past the claim, for a COMMIT that PostgreSQL never got.
   */
  readonly boundCommit?: boolean;
}

/**
 * Makes every statement sent on `client` wait at most `ms` for its answer (node-postgres's
 * per-statement query_timeout), until the returned function is called.
 */
function boundReads(client: pg.PoolClient, ms: number): () => void {
  const ownQuery = Object.hasOwn(client, 'query');
  const query = client.query;
  client.query = function (this: pg.PoolClient, config: unknown, ...rest: unknown[]) {
    const bounded =
      typeof config === 'string'
        ? { text: config, query_timeout: ms }
        : config !== null && typeof config === 'object' && !('submit' in config)
          ? { query_timeout: ms, ...config }
          : config;
    return (query as (...args: unknown[]) => unknown).call(this, bounded, ...rest);
  } as typeof client.query;
  return () => {
    if (ownQuery) client.query = query;
    else delete (client as { query?: unknown }).query;
  };
}

/**
 * COMMIT waits for its answer as long as the connection's own read timeout says (node-postgres
 * takes a query_timeout of 0 as none given), never a checkout's shorter one (readTimeoutMs): a
 * COMMIT whose answer was not waited for may still commit. The poll's did (a COMMIT slower than
 * its bound: an fsync, a synchronous standby), and the runs it claimed were left claimed with no
 * one to call them, until their claims expired and the reaper counted a forgiven expiry against
 * each; waited for, they are called, or handed back uncounted when too late (claim-too-late).
 */
const COMMIT = { text: 'COMMIT', query_timeout: 0 };

/**
 * Runs `work` in a transaction on one client (withClient); rolls back on any error and rethrows
 * it. A client whose session ended or whose read timed out is discarded, not rolled back. The
 * checkout's read timeout (`options`) bounds every statement but COMMIT (see COMMIT), and COMMIT
 * too with `boundCommit`.
 */
export async function inTransaction<T>(
  pool: Connections,
  work: (client: pg.PoolClient) => Promise<T>,
  options: CheckoutOptions = {},
): Promise<T> {
  return withClient(
    pool,
    async (client, lost) => {
      await client.query('BEGIN');
      const result = await work(client);
      const connectionError = lost();
      if (connectionError) throw connectionError;
      await client.query(options.boundCommit ? 'COMMIT' : COMMIT);
      return result;
    },
    async (client, err) => {
      if (isReadTimeout(err)) return false;
      try {
        await client.query('ROLLBACK');
        return true;
      } catch {
        // The connection is unusable: make the pool discard it instead of handing it out again.
        return false;
      }
    },
    options,
  );
}

/** The readiness probe's statement: the database answers at all. */
export async function ping(db: Queryable): Promise<void> {
  await db.query('SELECT 1');
}

/**
 * The database clock as epoch milliseconds, read as the statement runs (clock_timestamp(), not
 * the transaction's now()); the workers' clock estimate samples it (execution/db-clock.ts).
 */
export async function databaseEpochMs(db: Queryable): Promise<number | undefined> {
  const { rows } = await db.query<{ ms: number }>(
    `SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8 AS ms`,
  );
  return rows[0]?.ms;
}
