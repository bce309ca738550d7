import { parseArgs } from 'node:util';

export const CLI_USAGE = `API commands (talk to HELIOS_API_URL, default http://127.0.0.1:8080, with HELIOS_API_TOKEN):
  jobs list                     all jobs
  jobs get JOB                  one job (JOB is an id or a name)
  jobs create -f FILE           create the job(s) in FILE (a JSON object or array; a folder; - for stdin)
  jobs apply -f FILE            create or update by name, so job files can live in git (idempotent)
  jobs delete JOB               delete a job and its runs
  jobs trigger JOB              run a job now
  jobs pause JOB | resume JOB   disable or enable a job
  runs JOB [--state S]          a job's runs, newest first
  run RUN                       one run with its attempts
  dead-letters list [--open]    runs that used up their attempts
  dead-letters replay ID        re-queue a dead run as a new attempt
  cluster                       leader, nodes, outbox, run queues, open dead letters

options: --json (machine-readable output), --limit N, -f FILE
exit codes: 0 ok, 1 the API refused (the problem's title and fields go to stderr), 2 usage
`;

/** The command line was wrong; printed with the usage, exit code 2. */
export class UsageError extends Error {
  override name = 'UsageError';
}

/** Parsed options shared by every API command. */
export interface CommandArgs {
  readonly positionals: string[];
  readonly json: boolean;
  readonly file?: string;
  readonly limit?: number;
  readonly state?: string;
  readonly open: boolean;
}

export function parseCommandArgs(argv: string[]): CommandArgs {
  let parsed;
  try {
    parsed = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        json: { type: 'boolean', default: false },
        file: { type: 'string', short: 'f' },
        limit: { type: 'string' },
        state: { type: 'string' },
        open: { type: 'boolean', default: false },
      },
    });
  } catch (err) {
    throw new UsageError(err instanceof Error ? err.message : String(err));
  }
  const { values, positionals } = parsed;
  const limit = values.limit === undefined ? undefined : Number(values.limit);
  if (limit !== undefined && (!Number.isInteger(limit) || limit < 1)) {
    throw new UsageError('--limit must be a positive integer');
  }
  return {
    positionals,
    json: values.json ?? false,
    file: values.file,
    limit,
    state: values.state,
    open: values.open ?? false,
  };
}
