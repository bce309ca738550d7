#!/usr/bin/env node
import { ConfigError, loadConfig } from './config/index.js';
import { unknownVariables } from './config/unknown-variables.js';
import { toError } from './errors.js';
import { createLogger, type Logger } from './observability/logger.js';
import { HeliosNode } from './node.js';
import { createPool } from './store/db.js';
import { migrate } from './store/migrate.js';
import { CLI_COMMANDS, runCli } from './cli/index.js';
import { createEtcdClient } from './coordination/etcd.js';
import { fenceStatus, resetFence, type FenceStatus } from './coordination/fence-reset.js';
import { CLI_USAGE } from './cli/usage.js';

const USAGE = `usage: helios <command>

commands:
  node      run a Helios node (roles from HELIOS_ROLES), configured by HELIOS_* variables
  migrate   apply pending database migrations and exit
  fence status   show the leader fence, etcd's revision and the leader (needs the database and etcd)
  fence reset    lower the fence to etcd's revision after etcd was restored or replaced; refuses
                 while a leader holds the key (stop every scheduler first: see README, Operations)

${CLI_USAGE}`;

async function runNode(): Promise<void> {
  const config = loadConfig();
  const node = new HeliosNode({ config });
  warnOfUnknownVariables(node.logger);
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

/**
 * One warning for the HELIOS_* variables no setting reads (config/unknown-variables.ts): a
 * misspelt setting runs on its default otherwise without a word.
 */
function warnOfUnknownVariables(logger: Logger): void {
  const unknown = unknownVariables(process.env);
  if (unknown.length === 0) return;
  logger.warn(
    { variables: unknown },
    `ignoring ${unknown
      .map((v) => (v.nearest ? `${v.name} (did you mean ${v.nearest}?)` : v.name))
      .join(', ')}: no setting of this release reads ${unknown.length === 1 ? 'it' : 'them'}`,
  );
}

/** What a one-off node-side command (`migrate`, `fence`) needs: the config, a logger, a small pool. */
function commandContext(applicationName: string) {
  const config = loadConfig();
  const logger = createLogger({ level: config.node.logLevel, nodeId: config.node.id });
  warnOfUnknownVariables(logger);
  const pool = createPool({ connectionString: config.database.url, max: 2, logger, applicationName });
  return { config, logger, pool };
}

async function runMigrate(): Promise<void> {
  const { logger, pool } = commandContext('helios-migrate');
  try {
    const applied = await migrate(pool);
    logger.info({ applied }, applied.length ? 'migrations applied' : 'schema is up to date');
  } finally {
    await pool.end();
  }
}

/**
 * `helios fence status|reset`: a node-side command like `migrate` (HELIOS_DATABASE_URL,
 * HELIOS_ETCD_ENDPOINTS, HELIOS_ETCD_PREFIX), not a REST call: the fence is the last guard
 * against two leaders writing, so lowering it takes the operator's own access to PostgreSQL and
 * etcd, and works with every node stopped, as the procedure requires. Exit 1 when refused.
 */
async function runFence(sub: string | undefined): Promise<void> {
  if (sub !== 'status' && sub !== 'reset') {
    process.stderr.write(`usage: helios fence status|reset\n`);
    process.exitCode = 2;
    return;
  }
  const { config, pool } = commandContext('helios-fence');
  const etcd = createEtcdClient(config.etcd.endpoints);
  const leaderKey = `${config.etcd.prefix}/leader`;
  const out = (line: string) => process.stdout.write(`${line}\n`);
  try {
    const describe = (status: FenceStatus) => {
      out(
        `fence token:   ${status.fence.token} (written by ${status.fence.nodeId ?? 'nobody'} at ${status.fence.updatedAt.toISOString()})`,
      );
      out(`etcd revision: ${status.etcdRevision}`);
      out(
        `leader:        ${status.leader ? `${status.leader.nodeId} (token ${status.leader.token})` : 'none'}`,
      );
    };
    if (sub === 'status') {
      const status = await fenceStatus(pool, etcd, leaderKey);
      describe(status);
      if (status.fenceAhead)
        out(
          'the fence is ahead of etcd: no leader can write (etcd restored or replaced?); see `helios fence reset`',
        );
      return;
    }
    const result = await resetFence(pool, etcd, leaderKey);
    switch (result.outcome) {
      case 'reset':
        out(
          `fence reset from ${result.from} to ${result.to}: the next leader elected in this etcd can write`,
        );
        return;
      case 'not-needed':
        describe(result.status);
        out('the fence is not ahead of etcd: nothing to reset');
        return;
      case 'leader-present':
        describe(result.status);
        process.stderr.write(
          `helios: refusing to reset the fence while ${result.status.leader!.nodeId} holds ${leaderKey}; stop every node with the scheduler role (and make sure no node of the old etcd can still write), then run it again\n`,
        );
        process.exitCode = 1;
        return;
      case 'changed-meanwhile':
        process.stderr.write(
          'helios: the fence changed while resetting (a leader wrote); nothing was changed\n',
        );
        process.exitCode = 1;
        return;
    }
  } finally {
    etcd.close();
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
    case 'fence':
      return runFence(argv[1]);
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
