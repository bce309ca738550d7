#!/usr/bin/env node
import { loadConfig } from './config.js';
import { ConfigError, toError } from './errors.js';
import { createLogger } from './observability/logger.js';
import { HeliosNode } from './node.js';
import { createPool } from './store/db.js';
import { migrate } from './store/migrate.js';
import { CLI_COMMANDS, runCli } from './cli/index.js';
import { CLI_USAGE } from './cli/usage.js';

const USAGE = `usage: helios <command>

commands:
  node      run a Helios node (roles from HELIOS_ROLES), configured by HELIOS_* variables
  migrate   apply pending database migrations and exit

${CLI_USAGE}`;

async function runNode(): Promise<void> {
  const config = loadConfig();
  const node = new HeliosNode({ config });
  let signals = 0;
  const shutdown = (signal: NodeJS.Signals) => {
    signals += 1;
    if (signals > 1) {
      node.logger.warn({ signal }, 'second signal: exiting now');
      process.exit(130);
    }
    node.logger.info({ signal }, 'shutting down');
    node.stop().then(
      () => process.exit(0),
      (err: unknown) => {
        node.logger.error({ err: toError(err) }, 'shutdown finished with errors');
        process.exit(1);
      },
    );
  };
  process.on('SIGTERM', shutdown);
  process.on('SIGINT', shutdown);
  await node.start();
}

async function runMigrate(): Promise<void> {
  const config = loadConfig();
  const logger = createLogger({ level: config.logLevel, nodeId: config.nodeId });
  const pool = createPool({
    connectionString: config.databaseUrl,
    max: 2,
    logger,
    applicationName: 'helios-migrate',
  });
  try {
    const applied = await migrate(pool);
    logger.info({ applied }, applied.length ? 'migrations applied' : 'schema is up to date');
  } finally {
    await pool.end();
  }
}

async function main(argv: string[]): Promise<void> {
  const [command] = argv;
  switch (command) {
    case 'node':
      return runNode();
    case 'migrate':
      return runMigrate();
    case undefined:
    case 'help':
    case '--help':
      process.stdout.write(USAGE);
      return;
    default:
      if (Object.hasOwn(CLI_COMMANDS, command)) {
        process.exitCode = await runCli(command, argv.slice(1));
        return;
      }
      process.stderr.write(`unknown command "${command}"\n${USAGE}`);
      process.exitCode = 2;
  }
}

main(process.argv.slice(2)).catch((err: unknown) => {
  const error = toError(err);
  // Configuration errors are the user's to fix: one clear line, no stack.
  console.error(error instanceof ConfigError ? `helios: ${error.message}` : error);
  process.exit(1);
});
