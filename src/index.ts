// The programmatic API (package.json `main`): embed a node, manage jobs from TypeScript, or talk
// to a running cluster with the typed REST client the CLI uses. Exported by name; nothing else
// under src/ is part of the public surface.
import { loadConfig, type HeliosConfig } from './config/index.js';
import { HeliosNode, type HeliosNodeOptions } from './node.js';

export {
  ConfigError,
  loadConfig,
  loadCliConfig,
  type HeliosConfig,
  type CliConfig,
  type Role,
  type ApiRole,
} from './config/index.js';
export { HeliosNode, type HeliosNodeOptions } from './node.js';
export { JobUtils, makeJobUtils } from './job-utils.js';
export { ApiClient, ApiError, UnreachableError, type Problem } from './cli/client.js';
export {
  createJob,
  deleteJob,
  patchJob,
  pauseJob,
  replayDeadLetter,
  resumeJob,
  triggerJob,
  type CommandOptions,
  type JobChange,
  type ReplayOutcome,
  type TriggerResult,
} from './jobs/commands.js';
export { compileJob } from './api/job-input.js';
export { ProblemError, type FieldError } from './api/problems.js';
export type { Job, JobInput, JobPatch, Run, RunDetail, DeadLetter, Cluster } from './api/schemas.js';
export {
  ClaimLostError,
  LifecycleError,
  NotLeaderError,
  StaleFencingTokenError,
  TimeoutError,
} from './errors.js';
export { DuplicateJobNameError, type JobRecord, type JobRef } from './store/jobs.js';
export type { Database } from './store/db.js';
export type * from './model.js';

/**
 * Starts a node in this process, configured like `helios node` (HELIOS_* variables from `env`,
 * default `process.env`) or by a config already loaded. Resolves once every part has started;
 * stop it with `node.stop()` (graceful, bounded by HELIOS_SHUTDOWN_TIMEOUT_MS per part). Signals
 * are the embedding program's to handle.
 */
export async function startNode(
  options: { env?: Record<string, string | undefined>; config?: HeliosConfig } & Omit<
    HeliosNodeOptions,
    'config'
  > = {},
): Promise<HeliosNode> {
  const { env, config, ...rest } = options;
  const node = new HeliosNode({ ...rest, config: config ?? loadConfig(env) });
  await node.start();
  return node;
}
