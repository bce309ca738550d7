import { ConfigError, loadCliConfig } from '../config/index.js';
import { ApiClient, ApiError, UnreachableError } from './client.js';
import { clusterCommand, deadLettersCommand, runCommand, runsCommand } from './commands.js';
import { JobFileError } from './job-files.js';
import { jobsCommand } from './jobs.js';
import { processOutput, type Output } from './output.js';
import { CLI_USAGE, parseCommandArgs, UsageError, type CommandArgs } from './usage.js';

type Command = (client: ApiClient, args: CommandArgs, io: Output) => Promise<void>;

/** The API commands of `helios`; main.ts routes these names here. */
export const CLI_COMMANDS: Record<string, Command> = {
  jobs: jobsCommand,
  runs: runsCommand,
  run: runCommand,
  'dead-letters': deadLettersCommand,
  cluster: clusterCommand,
};

/** One line per failing field, after the problem's title: what a person needs to fix the input. */
function describeProblem(error: ApiError): string[] {
  const { problem, status } = error;
  const lines = [
    `helios: ${problem.title ?? 'request failed'} (HTTP ${status})${problem.detail ? `: ${problem.detail}` : ''}`,
  ];
  for (const { field, message } of problem.errors ?? []) lines.push(`  ${field}: ${message}`);
  return lines;
}

/**
 * Runs `helios <command> ...argv` against the API and returns the exit code: 0 done, 1 the API
 * or a file refused, 2 a usage error. Never throws for expected failures.
 */
export async function runCli(
  command: string,
  argv: string[],
  io: Output = processOutput,
  /** Default: the process environment (read by src/config/). */
  env?: Record<string, string | undefined>,
): Promise<number> {
  const run = CLI_COMMANDS[command];
  try {
    if (!run) throw new UsageError(`unknown command "${command}"`);
    const args = parseCommandArgs(argv);
    await run(new ApiClient(loadCliConfig(env)), args, io);
    return 0;
  } catch (err) {
    if (err instanceof ApiError) {
      for (const line of describeProblem(err)) io.err(line);
      return 1;
    }
    if (err instanceof UsageError) {
      io.err(`helios: ${err.message}\n\n${CLI_USAGE}`);
      return 2;
    }
    if (err instanceof UnreachableError || err instanceof JobFileError || err instanceof ConfigError) {
      io.err(`helios: ${err.message}`);
      return 1;
    }
    throw err;
  }
}
