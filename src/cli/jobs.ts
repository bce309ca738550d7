import type { Job } from '../api/schemas.js';
import type { ApiClient } from './client.js';
import { applyJob, readJobDocuments } from './job-files.js';
import { details, json, table, type Output } from './output.js';
import { UsageError, type CommandArgs } from './usage.js';

const ref = (args: CommandArgs) => {
  const name = args.positionals[0];
  if (!name) throw new UsageError('a job id or name is required');
  return name;
};

const file = (args: CommandArgs) => {
  if (!args.file) throw new UsageError('-f FILE is required (a JSON file, a folder of them, or - for stdin)');
  return args.file;
};

function showJob(job: Job): string {
  return details([
    ['id', job.id],
    ['name', job.name],
    ['schedule', job.schedule],
    ['timezone', job.timezone],
    ['enabled', job.enabled],
    ['next run', job.nextRunAt],
    ['target', `${job.target.method} ${job.target.url}`],
    ['headers', job.target.headers],
    ['body', job.target.body],
    ['timeout ms', job.timeoutMs],
    ['retry', job.retry],
    ['concurrency', job.concurrency],
    ['misfire', `${job.misfire} (max catch-up ${job.maxCatchUp})`],
    ['created', job.createdAt],
    ['updated', job.updatedAt],
  ]);
}

/** `helios jobs list|get|create|apply|delete|trigger|pause|resume`. */
export async function jobsCommand(client: ApiClient, args: CommandArgs, io: Output): Promise<void> {
  const [action, ...rest] = args.positionals;
  const sub = { ...args, positionals: rest };
  switch (action) {
    case 'list': {
      const jobs = await client.listJobs(args.limit);
      io.out(
        args.json
          ? json(jobs)
          : table(
              ['name', 'schedule', 'timezone', 'enabled', 'next run', 'target', 'id'],
              jobs.map((j) => [j.name, j.schedule, j.timezone, j.enabled, j.nextRunAt, j.target.url, j.id]),
            ),
      );
      return;
    }
    case 'get': {
      const job = await client.getJob(ref(sub));
      io.out(args.json ? json(job) : showJob(job));
      return;
    }
    case 'create': {
      const created: Job[] = [];
      for (const { job } of await readJobDocuments(file(args))) {
        created.push(await client.createJob(job));
        if (!args.json) io.out(`created job ${created.at(-1)!.name} (${created.at(-1)!.id})`);
      }
      if (args.json) io.out(json(created.length === 1 ? created[0] : created));
      return;
    }
    case 'apply': {
      const results = [];
      for (const { job } of await readJobDocuments(file(args))) {
        const result = await applyJob(client, job);
        results.push({ outcome: result.outcome, job: result.job });
        if (!args.json) io.out(`job ${result.job.name} ${result.outcome}`);
      }
      if (args.json) io.out(json(results));
      return;
    }
    case 'delete':
      await client.deleteJob(ref(sub));
      if (!args.json) io.out(`deleted job ${sub.positionals[0]}`);
      return;
    case 'trigger': {
      const result = await client.triggerJob(ref(sub));
      io.out(args.json ? json(result) : `triggered job ${sub.positionals[0]}: run ${result.runId}`);
      return;
    }
    case 'pause':
    case 'resume': {
      const job = await (action === 'pause' ? client.pauseJob(ref(sub)) : client.resumeJob(ref(sub)));
      io.out(
        args.json
          ? json(job)
          : `job ${job.name} ${action === 'pause' ? 'paused' : `resumed, next run ${job.nextRunAt ?? '-'}`}`,
      );
      return;
    }
    default:
      throw new UsageError(action ? `unknown jobs command "${action}"` : 'a jobs command is required');
  }
}
