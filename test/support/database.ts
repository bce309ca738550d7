import { createHash } from 'node:crypto';
import pg from 'pg';
import { loadMigrations, migrate } from '../../src/store/migrate.js';
import { serverEnv, uniqueId } from './env.js';

function withDatabase(url: string, database: string): string {
  const parsed = new URL(url);
  parsed.pathname = `/${database}`;
  return parsed.toString();
}

async function adminQuery<T>(work: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: withDatabase(serverEnv().databaseUrl, 'postgres') });
  await client.connect();
  try {
    return await work(client);
  } finally {
    await client.end();
  }
}

/**
 * Makes (once per migration set) a migrated template database, so each test file can clone its
 * own isolated database in a few milliseconds instead of migrating from scratch. Named by its
 * migrations' hash: checkouts with other migrations (a branch beside main) test on the same server
 * without dropping each other's template while it is being cloned. Returns its name.
 */
async function ensureTemplate(): Promise<string> {
  const migrations = await loadMigrations(new URL('../../src/store/migrations/', import.meta.url).pathname);
  const hash = createHash('sha256')
    .update(migrations.map((m) => m.sql).join('\n'))
    .digest('hex')
    .slice(0, 16);
  const template = `helios_template_${hash}`;
  await adminQuery(async (admin) => {
    // Serialise template creation between test processes.
    await admin.query('SELECT pg_advisory_lock(727002)');
    try {
      // Made whole or not at all: marked ready (its comment) only once migrated.
      const { rows } = await admin.query<{ comment: string | null }>(
        `SELECT shobj_description(oid, 'pg_database') AS comment FROM pg_database WHERE datname = $1`,
        [template],
      );
      if (rows[0]?.comment === 'ready') return;
      if (rows.length > 0) await admin.query(`DROP DATABASE ${template} WITH (FORCE)`);
      await admin.query(`CREATE DATABASE ${template}`);
      const pool = new pg.Pool({ connectionString: withDatabase(serverEnv().databaseUrl, template), max: 1 });
      try {
        await migrate(pool, migrations);
      } finally {
        await pool.end();
      }
      await admin.query(`COMMENT ON DATABASE ${template} IS 'ready'`);
    } finally {
      await admin.query('SELECT pg_advisory_unlock(727002)');
    }
  });
  return template;
}

export interface TestDatabase {
  readonly name: string;
  readonly url: string;
  /** A small pool for the test's own queries. */
  readonly pool: pg.Pool;
  drop(): Promise<void>;
}

/** A fresh database for one test file: migrated (cloned from the template) unless `empty`. */
export async function createTestDatabase(options: { empty?: boolean } = {}): Promise<TestDatabase> {
  const template = options.empty ? null : await ensureTemplate();
  const name = `helios_t_${uniqueId()}`;
  await adminQuery(async (admin) => {
    await admin.query(template ? `CREATE DATABASE ${name} TEMPLATE ${template}` : `CREATE DATABASE ${name}`);
  });
  const url = withDatabase(serverEnv().databaseUrl, name);
  const pool = new pg.Pool({ connectionString: url, max: 4, options: '-c TimeZone=UTC' });
  pool.on('error', () => undefined);
  return {
    name,
    url,
    pool,
    drop: async () => {
      await pool.end();
      await adminQuery((admin) => admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`));
    },
  };
}

/** The token the fence holds: the highest epoch that has committed a leader write. */
export async function fenceToken(pool: pg.Pool): Promise<bigint> {
  const { rows } = await pool.query<{ token: string }>('SELECT token::text AS token FROM leader_fence');
  return BigInt(rows[0]!.token);
}

/**
 * Holds the fence row locked, as an operator's long transaction would, while `during` runs: every
 * leader write waits behind it. Returns once the lock is released.
 */
export async function withFenceLocked(pool: pg.Pool, during: () => Promise<void>): Promise<void> {
  const holder = await pool.connect();
  try {
    await holder.query('BEGIN');
    await holder.query('SELECT token FROM leader_fence WHERE id FOR UPDATE');
    await during();
  } finally {
    await holder.query('COMMIT').catch(() => undefined);
    holder.release();
  }
}
