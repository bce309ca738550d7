import type { HeliosConfig } from './config/index.js';
import { createLogger, type Logger } from './observability/logger.js';
import { createPool, type Database } from './store/db.js';
import { migrate } from './store/migrate.js';
import { findJob } from './store/jobs.js';
import {
  createJob,
  deleteJob,
  patchJob,
  pauseJob,
  replayDeadLetter,
  resumeJob,
  triggerJob,
  type CommandOptions,
} from './jobs/commands.js';
import { compileJob, inputOf, type JobRules } from './api/job-input.js';
import { jobRef } from './api/routes/job-ref.js';
import { replayedRun, triggeredRun } from './api/command-answers.js';
import { notFound } from './api/problems.js';
import { JobInput, JobPatch, type Job } from './api/schemas.js';
import { checkInput } from './api/validation.js';
import { jobView } from './api/views.js';

/**
 * Job management from TypeScript without a running API: the same validation and the same job
 * commands as the REST routes, on a small pool of its own (graphile-worker's makeWorkerUtils).
 * Answers are the REST API's views (secrets masked); bad input and unknown jobs throw the
 * ProblemError the API would have answered with (`status` 400, 404, 409).
 */
export class JobUtils {
  private readonly commands: CommandOptions;
  private readonly rules: JobRules;
  private readonly view = (job: Parameters<typeof jobView>[0]) =>
    jobView(job, this.config.targets.sensitiveHeaders);

  constructor(
    private readonly config: HeliosConfig,
    /** The pool the commands run on; ended by release(). */
    readonly db: Database,
    logger: Logger,
  ) {
    this.rules = { targetPolicy: config.targets.policy, sensitiveHeaders: config.targets.sensitiveHeaders };
    this.commands = {
      runsTopic: config.kafka.runsTopic,
      misfireThresholdMs: config.leader.misfireThresholdMs,
      logger,
    };
  }

  /** Applies pending migrations (a node does so when it starts). */
  async migrate(): ReturnType<typeof migrate> {
    return migrate(this.db);
  }

  /** @throws ProblemError 400 naming the bad fields, 409 when the name is taken. */
  async createJob(input: JobInput): Promise<Job> {
    const valid = checkInput(JobInput, input);
    return this.view(await createJob(this.db, compileJob(valid, this.rules)));
  }

  /** A job by id or name. @throws ProblemError 404. */
  async getJob(idOrName: string): Promise<Job> {
    const job = await findJob(this.db, jobRef(idOrName));
    if (!job) throw notFound(`job "${idOrName}"`);
    return this.view(job);
  }

  /** Replaces the given top-level fields. @throws ProblemError 400, 404, 409. */
  async patchJob(idOrName: string, patch: JobPatch): Promise<Job> {
    const valid = checkInput(JobPatch, patch);
    const job = await patchJob(
      this.db,
      jobRef(idOrName),
      (current) => compileJob({ ...inputOf(current), ...valid }, this.rules, current),
      this.commands,
    );
    if (!job) throw notFound(`job "${idOrName}"`);
    return this.view(job);
  }

  /** @throws ProblemError 404. */
  async pauseJob(idOrName: string): Promise<Job> {
    const job = await pauseJob(this.db, jobRef(idOrName), this.commands);
    if (!job) throw notFound(`job "${idOrName}"`);
    return this.view(job);
  }

  /** @throws ProblemError 404. */
  async resumeJob(idOrName: string): Promise<Job> {
    const job = await resumeJob(this.db, jobRef(idOrName));
    if (!job) throw notFound(`job "${idOrName}"`);
    return this.view(job);
  }

  /** Deletes the job with its runs. @throws ProblemError 404. */
  async deleteJob(idOrName: string): Promise<void> {
    if (!(await deleteJob(this.db, jobRef(idOrName)))) throw notFound(`job "${idOrName}"`);
  }

  /** A run for now (`trigger = 'manual'`). @throws ProblemError 404, 409 (try again). */
  async triggerJob(idOrName: string): Promise<{ runId: string }> {
    return triggeredRun(await triggerJob(this.db, jobRef(idOrName), this.commands), idOrName);
  }

  /** Re-queues a dead run as a new attempt. @throws ProblemError 404, 409 (already replayed). */
  async replayDeadLetter(id: string): Promise<{ runId: string }> {
    return replayedRun(await replayDeadLetter(this.db, id, this.commands), id);
  }

  /** Ends the pool. */
  async release(): Promise<void> {
    await this.db.end();
  }
}

/** Opens JobUtils on the configured database (`config.database.url`), with a pool of 4. */
export function makeJobUtils(config: HeliosConfig, options: { logger?: Logger } = {}): JobUtils {
  const logger = options.logger ?? createLogger({ level: config.node.logLevel, nodeId: config.node.id });
  const db = createPool({
    connectionString: config.database.url,
    max: 4,
    logger,
    applicationName: 'helios-utils',
  });
  return new JobUtils(config, db, logger);
}
