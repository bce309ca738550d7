import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { attemptsOf, insertJob, nextWholeSecond, stopJobs, waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import type { ManagedProcess } from '../support/processes.js';

// The rolling restart of docs/operations.md (a Deployment's RollingUpdate, a compose service at a
// time): SIGTERM one node, wait until it has exited, start it again, wait until /readyz answers 200
// and its worker has joined the consumer group, then the next. Meanwhile every-second jobs: each
// occurrence due in the window has exactly one run, succeeded, and exactly one call at the target.

const JOBS = 4;
const NODES = 3;
let fx: IntegrationFixture;

before(async () => {
  fx = await integrationFixture();
});
after(() => fx.teardown());

/** One run as the database has it, and one call as the target received it. */
export interface RunRow {
  readonly jobId: string;
  readonly scheduledFor: number;
  readonly state: string;
}
export interface CallRow {
  readonly jobId: string;
  readonly scheduledFor: number;
}

/**
 * Every whole second in [from, to] of every job: exactly one run, succeeded, and exactly one call.
 * Pure, so the test below can show it reports a lost and a doubled occurrence.
 */
export function checkExactlyOnce(
  jobIds: string[],
  from: number,
  to: number,
  runs: RunRow[],
  calls: CallRow[],
): { due: number; problems: string[] } {
  const key = (jobId: string, at: number) => `${jobId}@${at}`;
  const runsAt = new Map<string, RunRow[]>();
  for (const r of runs)
    runsAt.set(key(r.jobId, r.scheduledFor), [...(runsAt.get(key(r.jobId, r.scheduledFor)) ?? []), r]);
  const callsAt = new Map<string, number>();
  for (const c of calls)
    callsAt.set(key(c.jobId, c.scheduledFor), (callsAt.get(key(c.jobId, c.scheduledFor)) ?? 0) + 1);
  const problems: string[] = [];
  let due = 0;
  for (const jobId of jobIds) {
    for (let at = Math.ceil(from / 1000) * 1000; at <= to; at += 1000) {
      due += 1;
      const where = `${jobId.slice(0, 8)} ${new Date(at).toISOString()}`;
      const found = runsAt.get(key(jobId, at)) ?? [];
      if (found.length !== 1) problems.push(`${where}: ${found.length} runs`);
      else if (found[0]!.state !== 'succeeded') problems.push(`${where}: run ${found[0]!.state}`);
      const called = callsAt.get(key(jobId, at)) ?? 0;
      if (called !== 1) problems.push(`${where}: ${called} calls`);
    }
  }
  return { due, problems };
}

async function ready(apiUrl: string): Promise<boolean> {
  try {
    return (await fetch(`${apiUrl}/readyz`)).status === 200;
  } catch {
    return false;
  }
}

/** Starts node `name` and waits until it is ready as the procedure says: /readyz 200 and in the group. */
async function startReady(name: string): Promise<ManagedProcess> {
  const { node, apiUrl } = await fx.start(name, { HELIOS_KAFKA_PARTITIONS: '6' }, { worker: true });
  await waitFor(`${name} ready`, () => ready(apiUrl), 20_000, 100);
  return node;
}

test(
  'a rolling restart of 3 nodes (SIGTERM, back and ready, next) loses and doubles no occurrence',
  { timeout: 100_000 },
  async (t) => {
    const started = Date.now();
    const live = await Promise.all(Array.from({ length: NODES }, (_, i) => startReady(`rr-${i}`)));
    const firstAt = await nextWholeSecond(fx.db.pool, 500);
    const jobIds: string[] = [];
    for (let i = 0; i < JOBS; i++) {
      jobIds.push(
        await insertJob(fx.db.pool, {
          name: `every-second-${i}`,
          schedule: '* * * * * *',
          target: { url: `${fx.target.url}/tick`, method: 'POST' },
          nextRunAt: firstAt,
        }),
      );
    }
    await fx.db.pool.query(`NOTIFY helios_jobs`);
    await sleep(firstAt.getTime() + 1500 - Date.now());
    const from = firstAt.getTime();
    const restarts: string[] = [];
    for (let i = 0; i < NODES; i++) {
      const old = live[i]!;
      const stopAt = Date.now();
      old.signal('SIGTERM');
      const { code } = await old.exited;
      assert.equal(code, 0, `${old.name} exits 0 after SIGTERM`);
      const exitedAt = Date.now();
      live[i] = await startReady(old.name);
      restarts.push(
        `${old.name}: stopped in ${exitedAt - stopAt} ms, back and ready in ${Date.now() - exitedAt} ms`,
      );
      await sleep(1000);
    }
    const to = Date.now() + 1000;
    t.diagnostic(restarts.join('; '));
    await sleep(to - Date.now() + 200);
    await stopJobs(fx.db.pool, jobIds);
    // Everything due up to `to` finished (runs already created ahead and withdrawn do not count).
    await waitFor(
      'the window settled',
      async () => {
        const { rows } = await fx.db.pool.query<{ n: string }>(
          `SELECT count(*) AS n FROM runs WHERE scheduled_for <= $1 AND state IN ('queued', 'running')`,
          [new Date(to)],
        );
        return rows[0]!.n === '0';
      },
      20_000,
      200,
    );
    const { rows } = await fx.db.pool.query<{ job_id: string; at: Date; state: string }>(
      `SELECT job_id, scheduled_for AS at, state FROM runs WHERE trigger = 'schedule'`,
    );
    const runs = rows.map((r) => ({ jobId: r.job_id, scheduledFor: r.at.getTime(), state: r.state }));
    const calls = fx.target.requests.map((r) => ({
      jobId: r.jobId,
      scheduledFor: Date.parse(r.scheduledFor),
    }));
    const { due, problems } = checkExactlyOnce(jobIds, from, to, runs, calls);
    t.diagnostic(
      `${due} occurrences due in ${((to - from) / 1000).toFixed(1)} s, test took ${((Date.now() - started) / 1000).toFixed(1)} s`,
    );
    assert.ok(due >= JOBS * 10, `the window holds occurrences (${due})`);
    if (problems.length > 0) {
      // Where the doubled or lost occurrences went: each call's attempt and each run's attempts.
      const doubled = fx.target.requests.filter(
        (r) => fx.target.requests.filter((o) => o.runId === r.runId).length > 1,
      );
      t.diagnostic(
        JSON.stringify(doubled.map((r) => ({ run: r.runId, attempt: r.attempt, at: r.arrivedAt }))),
      );
      for (const runId of new Set(doubled.map((r) => r.runId)))
        t.diagnostic(JSON.stringify(await attemptsOf(fx.db.pool, runId)));
    }
    assert.deepEqual(problems, [], `${problems.length} of ${due} occurrences went wrong`);

    // The checker sees a lost and a doubled occurrence: drop one run and its call, double another call.
    const mid = runs.find((r) => r.scheduledFor === Math.ceil((from + to) / 2000) * 1000)!;
    const lost = checkExactlyOnce(
      jobIds,
      from,
      to,
      runs.filter((r) => r !== mid),
      calls.filter((c) => !(c.jobId === mid.jobId && c.scheduledFor === mid.scheduledFor)),
    );
    assert.equal(lost.problems.length, 2, lost.problems.join('\n'));
    assert.match(lost.problems.join('\n'), /: 0 runs\n.*: 0 calls/);
    const doubled = checkExactlyOnce(jobIds, from, to, runs, [
      ...calls,
      calls.find((c) => c.scheduledFor > from)!,
    ]);
    assert.deepEqual(
      doubled.problems.map((p) => p.replace(/^.*: /, '')),
      ['2 calls'],
    );
  },
);
