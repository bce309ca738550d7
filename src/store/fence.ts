import type pg from 'pg';
import { StaleFencingTokenError } from '../errors.js';
import { inTransaction } from './db.js';

/** Raises the fence to our token unless a newer leader already wrote. $1 = token, $2 = node id. */
const RAISE_FENCE = `
  UPDATE leader_fence SET token = $1, node_id = $2, updated_at = now()
  WHERE id AND token <= $1`;

/**
 * Runs a leader write in one transaction that first raises the leader fence to `token`.
 * Zero rows updated means a leader with a newer token has written: the transaction rolls back and
 * StaleFencingTokenError is thrown, so a paused or partitioned old leader can write nothing.
 * The row lock taken by the UPDATE also serialises leader transactions of different epochs.
 */
export async function inFencedTransaction<T>(
  pool: pg.Pool,
  fence: { token: bigint; nodeId: string },
  work: (client: pg.PoolClient) => Promise<T>,
): Promise<T> {
  return inTransaction(pool, async (client) => {
    const { rowCount } = await client.query(RAISE_FENCE, [fence.token.toString(), fence.nodeId]);
    if (rowCount !== 1) throw new StaleFencingTokenError(fence.token);
    return work(client);
  });
}
