import { createHash } from 'node:crypto';
import pg from 'pg';
import { withTimeout } from '../errors.js';
import { isServerError, withClient } from './db.js';
import type { Connections } from './pool-share.js';

/**
 * Every node names its leader pool's sessions with this prefix (PostgreSQL's application_name),
 * so that a new leader can find the sessions of the leaders before it.
 */
const LEADER_SESSION_PREFIX = 'helios-leader:';

/** A session's statement as the stall watch logs it (SQL over `column`): one line, 160 characters. */
const statementText = (column: string) => `left(regexp_replace(${column}, '\\s+', ' ', 'g'), 160)`;

/** PostgreSQL keeps this many bytes of an application_name (NAMEDATALEN - 1). */
const APPLICATION_NAME_BYTES = 63;

/**
 * The application_name of a node's leader pool. Node ids (ASCII, up to 64 characters) can be
 * longer than PostgreSQL keeps after the prefix, and ids built from a long host name share their
 * beginning: cut by PostgreSQL, two nodes would carry one name and each would spare the other's
 * sessions as its own. A name too long keeps its beginning and ends with a hash of the whole id.
 */
export function leaderApplicationName(nodeId: string): string {
  const name = `${LEADER_SESSION_PREFIX}${nodeId}`;
  if (Buffer.byteLength(name) <= APPLICATION_NAME_BYTES) return name;
  const hash = createHash('sha256').update(nodeId).digest('hex').slice(0, 12);
  return `${name.slice(0, APPLICATION_NAME_BYTES - hash.length - 1)}~${hash}`;
}

/**
 * Ends the sessions of earlier leaders that are still inside a transaction, unless a newer leader
 * than us has already written. Run on the new leader's own pool: its application_name is ours.
 * $1 = our fencing token.
 */
const END_PREDECESSOR_SESSIONS = `
  SELECT a.application_name AS "applicationName", pg_terminate_backend(a.pid) AS ended
  FROM pg_stat_activity a
  WHERE a.datname = current_database()
    AND a.pid <> pg_backend_pid()
    AND starts_with(a.application_name, '${LEADER_SESSION_PREFIX}')
    AND a.application_name <> current_setting('application_name')
    AND a.xact_start IS NOT NULL
    AND (SELECT token FROM leader_fence WHERE id) <= $1`;

/**
 * A leader that lost its lease while inside a transaction (partitioned away, paused, killed
 * without its socket closing) keeps that transaction open in PostgreSQL, and with it the fence
 * row and the job and outbox rows it locked, until PostgreSQL notices: the idle transaction
 * timeout, or TCP keep-alive. Its writes can no longer commit (the fence), but until then the new
 * leader cannot raise the fence, and its dispatch skips the locked jobs; an occurrence held that
 * long would be found late enough to misfire. So a new leader ends those sessions first.
 *
 * Only sessions of another node's leader pool that are inside a transaction are ended, and none
 * once the fence holds a token above ours (a newer leader is writing: we are the stale one).
 * The fence says so only after the newer leader's first commit; before it, only our own epoch
 * can tell: `stillLeading` (the epoch's isValid) is asked on a connection already checked out,
 * right before the statement goes out, as every leader write asks it. A leader paused between
 * winning and this statement would otherwise wake up and end its successor's first transaction.
 * Returns the application names of the sessions ended, or null when the epoch had ended.
 */
export async function endPredecessorSessions(
  pool: Connections,
  token: bigint,
  stillLeading: () => boolean,
): Promise<string[] | null> {
  return withClient(pool, async (client) => {
    if (!stillLeading()) return null;
    const { rows } = await client.query<{ applicationName: string; ended: boolean }>(
      END_PREDECESSOR_SESSIONS,
      [token.toString()],
    );
    return rows.filter((r) => r.ended).map((r) => r.applicationName);
  });
}

/**
 * The sessions of a leader pool at work in PostgreSQL: running a statement (a lock wait included),
 * or inside a transaction whose last statement ended within the last second. A session whose
 * state cannot be seen counts as at work: NULL for another role's session, `disabled` where
 * track_activities is off. For each, what it runs (the statement's text, which carries no values:
 * every statement of ours sends them as parameters) and the sessions it waits for
 * (pg_blocking_pids, only asked here, after a stall): their application name, state and how long
 * their transaction has been open, and their statement only when their application name is a
 * Helios one (another client's statement could carry a literal secret). $1 = the pool's
 * application_name.
 */
const LEADER_SESSIONS_AT_WORK = `
  SELECT s.pid, s.state,
         nullif(concat_ws(':', s.wait_event_type, s.wait_event), '') AS "waitEvent",
         round(extract(epoch FROM clock_timestamp() - s.query_start) * 1000)::float8 AS "statementMs",
         ${statementText('s.query')} AS statement,
         -- pg_blocking_pids once per session (it briefly locks the lock manager), and a blocker
         -- with no session row kept (a prepared transaction blocks as pid 0).
         (SELECT coalesce(json_agg(json_build_object(
                   'pid', bp.pid,
                   'applicationName', b.application_name,
                   'state', b.state,
                   'transactionMs', round(extract(epoch FROM clock_timestamp() - b.xact_start) * 1000)::float8,
                   'statement', CASE WHEN b.application_name LIKE 'helios%'
                                     THEN ${statementText('b.query')} END)),
                   '[]')
          FROM unnest(pg_blocking_pids(s.pid)) AS bp (pid)
          LEFT JOIN pg_stat_activity b ON b.pid = bp.pid) AS "blockedBy"
  FROM pg_stat_activity s
  WHERE s.datname = current_database() AND s.application_name = $1
    AND (s.state IS NULL
         OR s.state = 'disabled'
         OR s.state = 'active'
         OR (s.state LIKE 'idle in transaction%' AND s.state_change > clock_timestamp() - interval '1 second'))`;

/** A leader-pool session at work, as the stall watch logs it (see LEADER_SESSIONS_AT_WORK). */
export interface LeaderSessionAtWork {
  readonly pid: number;
  readonly state: string | null;
  readonly waitEvent: string | null;
  readonly statementMs: number | null;
  readonly statement: string | null;
  readonly blockedBy: readonly {
    readonly pid: number;
    readonly applicationName: string | null;
    readonly state: string | null;
    readonly transactionMs: number | null;
    readonly statement: string | null;
  }[];
}

/**
 * What a new connection says about a leader none of whose dispatch passes PostgreSQL has answered
 * for a while (the leader's stall watch, coordination/leader-stall.ts):
 * `answering`, PostgreSQL answers and the leader's sessions are at work there (a slow statement,
 * a lock wait: stepping down would not help; `atWork` says what each does and waits for), or
 * answered with an error of its own (too many connections, starting up: every node meets the same
 * server); `sessions-lost`, it answers but none of the leader pool's sessions is at work there, so
 * the leader waits on connections whose answers cannot come (its server moved, a firewall forgot
 * them). Rejects when PostgreSQL cannot be reached at all within `timeoutMs`.
 */
export async function probeLeaderSessions(options: {
  connectionString: string;
  /** The probe's own application_name. */
  applicationName: string;
  /** The application_name of the leader pool whose sessions are looked for. */
  leaderApplicationName: string;
  timeoutMs: number;
}): Promise<{ verdict: 'answering' | 'sessions-lost'; atWork?: readonly LeaderSessionAtWork[] }> {
  const client = new pg.Client({
    connectionString: options.connectionString,
    application_name: options.applicationName,
    connectionTimeoutMillis: options.timeoutMs,
    query_timeout: options.timeoutMs,
  });
  // A session that ends under the probe emits 'error'; unheard, it would end the process.
  client.on('error', () => undefined);
  try {
    // One deadline for the connection and the look together.
    const { rows } = await withTimeout(
      (async () => {
        await client.connect();
        return client.query<LeaderSessionAtWork>(LEADER_SESSIONS_AT_WORK, [options.leaderApplicationName]);
      })(),
      options.timeoutMs,
      'the leader stall probe',
    );
    return rows.length > 0 ? { verdict: 'answering', atWork: rows } : { verdict: 'sessions-lost' };
  } catch (err) {
    // An error PostgreSQL itself sent (a SQLSTATE) proves it is reachable.
    if (isServerError(err)) return { verdict: 'answering' };
    throw err;
  } finally {
    // Not awaited: a connection that never answered must not hold the caller (end() destroys it).
    void client.end().catch(() => undefined);
  }
}
