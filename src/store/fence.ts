import type pg from 'pg';
import { StaleFencingTokenError } from '../errors.js';
import { inTransaction, type Queryable } from './db.js';

/**
 * Raises the fence to our token unless a newer leader already wrote. $1 = token, $2 = node id,
 * $3 = the etcd cluster and leader key the token comes from (Leadership.leaderKey; NULL: unknown).
 */
const RAISE_FENCE = `
  UPDATE leader_fence SET token = $1, node_id = $2, leader_key = $3, updated_at = now()
  WHERE id AND token <= $1`;

/**
 * Runs a leader write in one transaction that first raises the leader fence to `token`.
 * Zero rows updated means a leader with a newer token has written: the transaction rolls back and
 * StaleFencingTokenError is thrown, so a paused or partitioned old leader can write nothing.
 * The row lock taken by the UPDATE also serialises leader transactions of different epochs, and
 * those of one epoch: while one runs, every other leader write waits for its commit.
 */
export async function inFencedTransaction<T>(
  pool: pg.Pool,
  fence: { token: bigint; nodeId: string; leaderKey?: string },
  work: (client: pg.PoolClient) => Promise<T>,
  options: FencedTransactionOptions = {},
): Promise<T> {
  const { statementTimeoutMs } = options;
  if (statementTimeoutMs !== undefined && (!Number.isInteger(statementTimeoutMs) || statementTimeoutMs <= 0))
    throw new RangeError(`statementTimeoutMs must be a positive integer, got ${statementTimeoutMs}`);
  return inTransaction(pool, async (client) => {
    const { rowCount } = await client.query(RAISE_FENCE, [
      fence.token.toString(),
      fence.nodeId,
      fence.leaderKey ?? null,
    ]);
    if (rowCount !== 1) throw new StaleFencingTokenError(fence.token);
    if (statementTimeoutMs !== undefined)
      await client.query(`SET LOCAL statement_timeout = ${statementTimeoutMs}`);
    return work(client);
  });
}

/** Options of {@link inFencedTransaction}. */
export interface FencedTransactionOptions {
  /**
   * Each statement after the fence is raised is cancelled (SQLSTATE 57014) past this many
   * milliseconds, instead of the pool's statement_timeout (30 s): the fence row stays locked until
   * the transaction ends, and every other leader write waits for it. The wait for the fence row
   * itself keeps the pool's limit: cancelling it would free nothing (it holds nothing yet), and at
   * a takeover it waits for the old leader's transaction to end.
   */
  readonly statementTimeoutMs?: number;
}

/** The fence row. No parameters. */
const READ_FENCE = `
  SELECT token::text AS token, node_id AS "nodeId", updated_at AS "updatedAt" FROM leader_fence WHERE id`;

/**
 * Lowers (or sets) the fence, only if it still holds the token the caller saw.
 * $1 = new token, $2 = who wrote it (a marker, not a node), $3 = the token the caller read.
 */
const RESET_FENCE = `
  UPDATE leader_fence SET token = $1, node_id = $2, leader_key = NULL, updated_at = now()
  WHERE id AND token = $3`;

/** The highest fencing token that has written, and who wrote it. */
export interface FenceRow {
  readonly token: bigint;
  readonly nodeId: string | null;
  readonly updatedAt: Date;
}

export async function readFence(db: Queryable): Promise<FenceRow> {
  const { rows } = await db.query<{ token: string; nodeId: string | null; updatedAt: Date }>(READ_FENCE);
  const row = rows[0];
  if (!row) throw new Error('leader_fence has no row: is the schema migrated?');
  return { token: BigInt(row.token), nodeId: row.nodeId, updatedAt: row.updatedAt };
}

/**
 * Sets the fence to `token` if it still is `expected` (compare-and-set: a leader that wrote in
 * between wins). Returns false when it was not. Only for the operator's `helios fence reset`.
 */
export async function setFence(
  db: Queryable,
  token: bigint,
  expected: bigint,
  writer: string,
): Promise<boolean> {
  const { rowCount } = await db.query(RESET_FENCE, [token.toString(), writer, expected.toString()]);
  return rowCount === 1;
}
