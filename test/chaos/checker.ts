/**
 * The chaos checker: loads what happened (PostgreSQL, the target's requests, the run topic, the
 * nodes' logs) into plain arrays and runs the pure checks over them against the reference model.
 */
import type pg from 'pg';
import { setTimeout as sleep } from 'node:timers/promises';
import { withReadTimeout } from '../../src/store/db.js';
import { stopJobs, type TargetRequest } from '../support/execution.js';
import { TopicRecorder } from '../support/kafka.js';
import { checkAnnouncements, type Announcement, type OutboxRow } from './check-announcements.js';
import { checkLeaders } from './check-leaders.js';
import { checkOccurrences } from './check-occurrences.js';
import { checkPolicies } from './check-policies.js';
import { checkRuns } from './check-runs.js';
import { checkUnknownJobs } from './check-unknown-jobs.js';
import type { AttemptRow, DeadLetterRow, Delivery, Findings, Observations, RunRow } from './observations.js';

/** Runs every pure check; the order is the order of the report. */
export function judge(observed: Observations): Findings {
  // Late creates are judged as jobs of the model from here on.
  const unknown = checkUnknownJobs(observed);
  const obs = { ...observed, jobs: [...observed.jobs, ...unknown.lateCreates] };
  const parts = [unknown, checkOccurrences(obs), checkRuns(obs), checkPolicies(obs), checkLeaders(obs)];
  return {
    violations: parts.flatMap((p) => p.violations),
    lines: parts.flatMap((p) => p.lines),
  };
}

/** What a finished chaos run saw, beside the database and the run topic that judgeRun reads. */
export type RunRecord = Omit<Observations, 'runs' | 'attempts' | 'deadLetters' | 'deliveries'> & {
  /** Every request the target received. */
  readonly requests: readonly TargetRequest[];
};

/**
 * Judges a finished run (window closed, runs settled): loads its jobs' rows, runs the pure checks
 * and reads the run topic. The chaos run and the checker's live test judge the same way. Returns
 * the findings with what was loaded, for the post-mortem files.
 */
export async function judgeRun(
  pool: pg.Pool,
  runsTopic: string,
  run: RunRecord,
): Promise<Findings & { database: Awaited<ReturnType<typeof loadDatabase>>; deliveries: Delivery[] }> {
  const { requests, ...seen } = run;
  const loaded = await loadDatabase(pool, [
    ...run.jobs.map((j) => j.id),
    ...(run.unknownJobs ?? []).map((j) => j.id),
  ]);
  const database = { ...loaded, runsOfDeletedJobs: run.runsOfDeletedJobs ?? [] };
  const deliveries = deliveriesOf(requests);
  const result = judge({ ...seen, ...database, deliveries });
  const topic = await checkRunTopic(pool, runsTopic, run.faults);
  return {
    violations: [...result.violations, ...topic.violations],
    lines: [...result.lines, ...topic.lines],
    database,
    deliveries,
  };
}

/**
 * Ends the judged window: its end is the last whole second the dispatcher has passed for every
 * job (waiting up to 30 s for it to catch up), then the jobs stop as an API edit would stop them.
 * Returns the window's end (ms).
 */
export async function closeWindow(pool: pg.Pool, jobIds: string[]): Promise<number> {
  const windowEnd = Math.floor(Date.now() / 1000) * 1000 - 1000;
  for (let waited = 0; ; waited += 200) {
    const { rows: behind } = await pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM jobs WHERE id = ANY($1::uuid[]) AND enabled AND next_run_at <= $2`,
      [jobIds, new Date(windowEnd)],
    );
    if (behind[0]!.n === 0) break;
    if (waited > 30_000) throw new Error('the dispatcher did not catch up within 30 s');
    await sleep(200);
  }
  await stopJobs(pool, jobIds);
  return windowEnd;
}

/**
 * The jobs in the database that are not among `known` (the jobs the API's answers named): a create
 * that took effect after its client gave up on it (check-unknown-jobs.ts), or a job nobody made.
 */
export async function unknownJobs(pool: pg.Pool, known: string[]): Promise<{ id: string; name: string }[]> {
  const { rows } = await pool.query<{ id: string; name: string }>(
    `SELECT id, name FROM jobs WHERE NOT (id = ANY($1::uuid[])) ORDER BY created_at`,
    [known],
  );
  return rows;
}

/** Waits (up to `maxMs`) until no run is queued or running. */
export async function settle(pool: pg.Pool, maxMs: number): Promise<void> {
  for (let waited = 0; waited < maxMs; waited += 500) {
    const { rows: active } = await pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM runs WHERE state IN ('queued', 'running')`,
    );
    if (active[0]!.n === 0) return;
    await sleep(500);
  }
}

const ms = (d: Date | null) => (d === null ? null : d.getTime());

/** A run as PostgreSQL returns RUN_COLUMNS. */
interface RunColumns {
  id: string;
  job_id: string;
  scheduled_for: Date;
  trigger: 'schedule' | 'manual';
  state: string;
  attempt: number;
  max_attempts: number;
  reason: string | null;
  concurrency: string;
  created_epoch: string | null;
  created_at: Date;
  started_at: Date | null;
  finished_at: Date | null;
  timeout_ms: number;
}

const RUN_COLUMNS = `id, job_id, scheduled_for, trigger, state, attempt, max_attempts, reason, concurrency,
  created_epoch, created_at, started_at, finished_at, timeout_ms`;

function runRow(r: RunColumns): RunRow {
  return {
    id: r.id,
    jobId: r.job_id,
    scheduledFor: r.scheduled_for.getTime(),
    trigger: r.trigger,
    state: r.state,
    attempt: r.attempt,
    maxAttempts: r.max_attempts,
    reason: r.reason,
    concurrency: r.concurrency,
    createdEpoch: r.created_epoch === null ? null : BigInt(r.created_epoch),
    createdAt: r.created_at.getTime(),
    startedAt: ms(r.started_at),
    finishedAt: ms(r.finished_at),
    timeoutMs: r.timeout_ms,
  };
}

/**
 * The runs of job `jobId`, read by the nemesis just before it deletes the job: the delete takes the
 * job's runs with it, and with them the only record of why an occurrence made no call
 * (Observations.runsOfDeletedJobs). Bounded in time, as PostgreSQL may be down then; the caller
 * records nothing when it fails (the checker then sees what it saw before: no row).
 */
export async function readRunsBeforeDelete(pool: pg.Pool, jobId: string): Promise<RunRow[]> {
  const { rows } = await pool.query<RunColumns>(
    withReadTimeout({ text: `SELECT ${RUN_COLUMNS} FROM runs WHERE job_id = $1`, values: [jobId] }, 2000),
  );
  return rows.map(runRow);
}

/** Runs, attempts and dead letters of every job the chaos run made (deleted jobs' rows are gone). */
export async function loadDatabase(pool: pg.Pool, jobIds: string[]) {
  const { rows: runs } = await pool.query<RunColumns>(
    `SELECT ${RUN_COLUMNS} FROM runs WHERE job_id = ANY($1::uuid[])`,
    [jobIds],
  );
  const { rows: attempts } = await pool.query<{
    run_id: string;
    attempt: number;
    node_id: string;
    started_at: Date;
    finished_at: Date | null;
    outcome: string | null;
  }>(
    `SELECT a.run_id, a.attempt, a.node_id, a.started_at, a.finished_at, a.outcome
     FROM run_attempts a JOIN runs r ON r.id = a.run_id WHERE r.job_id = ANY($1::uuid[])`,
    [jobIds],
  );
  const { rows: letters } = await pool.query<{
    id: string;
    run_id: string;
    job_id: string;
    attempt: number;
    replayed_at: Date | null;
  }>(`SELECT id, run_id, job_id, attempt, replayed_at FROM dead_letters WHERE job_id = ANY($1::uuid[])`, [
    jobIds,
  ]);
  return {
    runs: runs.map(runRow),
    attempts: attempts.map((a): AttemptRow => ({
      runId: a.run_id,
      attempt: a.attempt,
      nodeId: a.node_id,
      startedAt: a.started_at.getTime(),
      finishedAt: ms(a.finished_at),
      outcome: a.outcome,
    })),
    deadLetters: letters.map((d): DeadLetterRow => ({
      id: d.id,
      runId: d.run_id,
      jobId: d.job_id,
      attempt: d.attempt,
      replayedAt: ms(d.replayed_at),
    })),
  };
}

export function deliveriesOf(requests: readonly TargetRequest[]): Delivery[] {
  return requests.map((r) => ({
    runId: r.runId,
    jobId: r.jobId,
    attempt: r.attempt,
    scheduledFor: Date.parse(r.scheduledFor),
    path: r.path,
    arrivedAt: r.arrivedAt,
    endedAt: r.endedAt,
    status: r.status,
    aborted: r.aborted,
  }));
}

/**
 * The outbox rows of the run topic, and the run topic itself read from the beginning by a fresh
 * consumer group, waiting (up to `waitMs`) until it holds at least as many messages as rows.
 */
export async function checkRunTopic(
  pool: pg.Pool,
  topic: string,
  faults: Observations['faults'],
  waitMs = 20_000,
): Promise<Findings> {
  const { rows } = await pool.query<{
    id: string;
    run_id: string;
    attempt: number;
    published_at: Date | null;
  }>(
    `SELECT id::text, payload->>'runId' AS run_id, (payload->>'attempt')::int AS attempt, published_at
     FROM outbox WHERE topic = $1`,
    [topic],
  );
  const outbox: OutboxRow[] = rows.map((r) => ({
    id: r.id,
    runId: r.run_id,
    attempt: r.attempt,
    publishedAt: ms(r.published_at),
  }));
  const recorder = new TopicRecorder(topic);
  await recorder.start();
  try {
    const deadline = Date.now() + waitMs;
    let last = -1;
    let stableSince = Date.now();
    // Enough messages and no new one for 2 s: the topic is read to its end.
    while (Date.now() < deadline) {
      const n = recorder.messages.length;
      if (n !== last) {
        last = n;
        stableSince = Date.now();
      }
      if (n >= outbox.length && Date.now() - stableSince > 2000) break;
      await new Promise((r) => setTimeout(r, 200));
    }
  } finally {
    await recorder.stop();
  }
  const messages = recorder.payloads<Announcement>().filter((m) => m && typeof m.runId === 'string');
  return checkAnnouncements(outbox, messages, faults);
}
