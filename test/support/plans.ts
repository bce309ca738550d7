import assert from 'node:assert/strict';
import type pg from 'pg';
import type { Queryable } from '../../src/store/db.js';

// What a store function sends, and how often each scan of its plan ran: for tests that make
// statistics which once turned a statement quadratic (reaper-stale-statistics, prune-stale-statistics).

/**
 * Turns autovacuum off for `tables`: the statistics a test makes must stay as they are for its
 * length (no analyze behind its back).
 */
export async function holdStatistics(pool: pg.Pool, ...tables: string[]): Promise<void> {
  for (const table of tables) await pool.query(`ALTER TABLE ${table} SET (autovacuum_enabled = false)`);
}

/** The statement `send` makes its Queryable run, and its parameters (captured, not run). */
export async function capturedStatement(
  send: (db: Queryable) => Promise<unknown>,
): Promise<{ sql: string; params: unknown[] }> {
  let captured: { sql: string; params: unknown[] } | undefined;
  const capture = {
    query: async (sql: string | { text: string }, params: unknown[]) => {
      captured = { sql: typeof sql === 'string' ? sql : sql.text, params };
      return { rows: [{}], rowCount: 0 };
    },
  } as unknown as Queryable;
  await send(capture);
  assert.ok(captured, 'no statement was sent');
  return captured;
}

interface PlanNode {
  'Node Type': string;
  Alias?: string;
  'Actual Loops': number;
  Plans?: PlanNode[];
}

/**
 * How many times each scan under the alias `alias` ran, executing `sql` with EXPLAIN ANALYZE in a
 * transaction that is rolled back (the rows stay for the next look).
 */
export async function loopsOfScan(
  pool: pg.Pool,
  sql: string,
  params: unknown[],
  alias: string,
): Promise<number[]> {
  const client = await pool.connect();
  try {
    await client.query('BEGIN');
    const { rows } = await client.query<{ 'QUERY PLAN': { Plan: PlanNode }[] }>(
      `EXPLAIN (ANALYZE, FORMAT JSON) ${sql}`,
      params,
    );
    const loops: number[] = [];
    const visit = (node: PlanNode) => {
      if (node.Alias === alias && /Scan/.test(node['Node Type'])) loops.push(node['Actual Loops']);
      for (const child of node.Plans ?? []) visit(child);
    };
    visit(rows[0]!['QUERY PLAN'][0]!.Plan);
    return loops;
  } finally {
    await client.query('ROLLBACK');
    client.release();
  }
}
