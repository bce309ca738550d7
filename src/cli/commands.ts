import type { ApiClient } from './client.js';
import { details, json, table, type Output } from './output.js';
import { UsageError, type CommandArgs } from './usage.js';

const required = (args: CommandArgs, what: string) => {
  const value = args.positionals[0];
  if (!value) throw new UsageError(`${what} is required`);
  return value;
};

/** `helios runs JOB [--state S] [--limit N]`: newest first, 20 unless --limit. */
export async function runsCommand(client: ApiClient, args: CommandArgs, io: Output): Promise<void> {
  const runs = await client.listRuns(required(args, 'a job id or name'), {
    ...(args.state ? { state: args.state } : {}),
    max: args.limit ?? 20,
  });
  io.out(
    args.json
      ? json(runs)
      : table(
          ['run', 'scheduled for', 'trigger', 'state', 'attempt', 'status', 'reason / error'],
          runs.map((r) => [
            r.id,
            r.scheduledFor,
            r.trigger,
            r.state,
            `${r.attempt}/${r.maxAttempts}`,
            r.lastStatus,
            r.lastError ?? r.reason,
          ]),
        ),
  );
}

/** `helios run RUN`: one run and its attempts. */
export async function runCommand(client: ApiClient, args: CommandArgs, io: Output): Promise<void> {
  const run = await client.getRun(required(args, 'a run id'));
  if (args.json) return io.out(json(run));
  io.out(
    details([
      ['run', run.id],
      ['job', run.jobId],
      ['scheduled for', run.scheduledFor],
      ['trigger', run.trigger],
      ['state', run.state],
      ['attempt', `${run.attempt}/${run.maxAttempts}`],
      ['reason', run.reason],
      ['last error', run.lastError],
      ['target', `${run.target.method} ${run.target.url}`],
    ]),
  );
  io.out('');
  io.out(
    table(
      ['attempt', 'node', 'started', 'outcome', 'status', 'ms', 'error'],
      run.attempts.map((a) => [
        a.attempt,
        a.nodeId,
        a.startedAt,
        a.outcome,
        a.statusCode,
        a.durationMs,
        a.error,
      ]),
    ),
  );
}

/** `helios dead-letters list [--open] | replay ID`. */
export async function deadLettersCommand(client: ApiClient, args: CommandArgs, io: Output): Promise<void> {
  const [action, ...rest] = args.positionals;
  if (action === 'list') {
    const letters = await client.listDeadLetters({
      open: args.open ?? false,
      ...(args.limit ? { max: args.limit } : {}),
    });
    io.out(
      args.json
        ? json(letters)
        : table(
            ['id', 'job', 'run', 'attempt', 'status', 'error', 'dead at', 'replayed at'],
            letters.map((d) => [
              d.id,
              d.jobName,
              d.runId,
              d.attempt,
              d.statusCode,
              d.error,
              d.createdAt,
              d.replayedAt,
            ]),
          ),
    );
    return;
  }
  if (action === 'replay') {
    const id = required({ ...args, positionals: rest }, 'a dead letter id');
    const result = await client.replayDeadLetter(id);
    io.out(args.json ? json(result) : `replayed: run ${result.runId} is queued again`);
    return;
  }
  throw new UsageError(action ? `unknown dead-letters command "${action}"` : 'list or replay is required');
}

/** `helios cluster`: leader, nodes, queues. */
export async function clusterCommand(client: ApiClient, args: CommandArgs, io: Output): Promise<void> {
  const cluster = await client.cluster();
  if (args.json) return io.out(json(cluster));
  const leader = cluster.leader;
  io.out(
    leader
      ? `leader: ${leader.nodeId} (fencing token ${leader.fencingToken}, since ${leader.since})`
      : 'leader: none',
  );
  const { outbox, runs, deadLetters } = cluster;
  // `?` from a node of a release before the count (a rolling upgrade).
  io.out(
    `runs queued: ${runs.queued}   overdue: ${runs.overdue}   waiting (forbid): ${runs.waitingForbid ?? '?'}   running: ${runs.running}   dead letters open: ${deadLetters.open}`,
  );
  io.out(`outbox pending: ${outbox.pending}   oldest due waited: ${outbox.oldestDueAgeSeconds.toFixed(1)} s`);
  io.out('');
  io.out(
    table(
      ['node', 'host', 'pid', 'roles', 'api', 'last seen'],
      cluster.nodes.map((n) => [n.id, n.host, n.pid, n.roles.join(','), n.apiUrl, n.lastSeen]),
    ),
  );
}
