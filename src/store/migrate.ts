import { readdir, readFile } from 'node:fs/promises';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';
import type pg from 'pg';
import { inTransaction } from './db.js';

const MIGRATIONS_DIR = fileURLToPath(new URL('./migrations/', import.meta.url));
/** Arbitrary constant shared by every Helios node: the advisory lock that serialises migrations. */
const MIGRATION_LOCK_KEY = 727_001;

export interface Migration {
  readonly version: number;
  readonly name: string;
  readonly sql: string;
}

/** Reads `NNN_name.sql` files in version order. */
export async function loadMigrations(dir = MIGRATIONS_DIR): Promise<Migration[]> {
  const files = (await readdir(dir)).filter((f) => /^\d{3}_[\w-]+\.sql$/.test(f)).sort();
  return Promise.all(
    files.map(async (file) => ({
      version: Number(file.slice(0, 3)),
      name: file.slice(4, -4),
      sql: await readFile(`${dir}/${file}`, 'utf8'),
    })),
  );
}

/** Options of {@link migrate}. */
export interface MigrateOptions {
  /**
   * How long a migration statement waits for a table lock before the migration gives up and is
   * tried again (`lock_timeout`); default 5000 ms. While an ALTER waits for its lock, every
   * statement that touches the table queues behind it: claims and dispatch would stall as long.
   */
  readonly lockTimeoutMs?: number;
  /** Tries in all when a lock was not had in time, a second apart more each time; default 6. */
  readonly tries?: number;
}

/**
 * Applies pending migrations in order, all in one transaction, under an advisory lock so two nodes
 * starting at once apply each migration exactly once. Returns the versions it applied. A
 * migration that cannot have its table lock within `lockTimeoutMs` (a long transaction holds the
 * table) rolls back and is tried again, so the nodes' work never queues behind it for long; after
 * `tries` the error (SQLSTATE 55P03) propagates.
 */
export async function migrate(
  pool: pg.Pool,
  migrations?: Migration[],
  options: MigrateOptions = {},
): Promise<number[]> {
  const all = migrations ?? (await loadMigrations());
  const tries = options.tries ?? 6;
  for (let attempt = 1; ; attempt++) {
    try {
      return await migrateOnce(pool, all, options.lockTimeoutMs ?? 5000);
    } catch (err) {
      if ((err as { code?: unknown } | null)?.code !== LOCK_NOT_AVAILABLE || attempt >= tries) throw err;
      await sleep(1000 * attempt);
    }
  }
}

/** SQLSTATE lock_not_available: a lock_timeout passed. */
const LOCK_NOT_AVAILABLE = '55P03';

async function migrateOnce(pool: pg.Pool, all: Migration[], lockTimeoutMs: number): Promise<number[]> {
  return inTransaction(pool, async (client) => {
    await client.query('SELECT pg_advisory_xact_lock($1)', [MIGRATION_LOCK_KEY]);
    // After the advisory lock: waiting for another node's migration is not a table lock.
    await client.query(`SET LOCAL lock_timeout = ${Math.max(1, Math.round(lockTimeoutMs))}`);
    await client.query(`CREATE TABLE IF NOT EXISTS schema_migrations (
      version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`);
    const { rows } = await client.query<{ version: number }>('SELECT version FROM schema_migrations');
    const applied = new Set(rows.map((r) => r.version));
    const done: number[] = [];
    for (const migration of all) {
      if (applied.has(migration.version)) continue;
      await client.query(migration.sql);
      await client.query('INSERT INTO schema_migrations (version, name) VALUES ($1, $2)', [
        migration.version,
        migration.name,
      ]);
      done.push(migration.version);
    }
    return done;
  });
}
