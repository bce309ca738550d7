import assert from 'node:assert/strict';
import { after, afterEach, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { DbClock } from '../../src/execution/db-clock.js';
import { RunClaimer } from '../../src/execution/run-claimer.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { inTransaction } from '../../src/store/db.js';
import { claimOverdueRuns } from '../../src/store/overdue.js';
import { claimRuns, type ClaimOptions, type EndedEpochsReading } from '../../src/store/runs.js';
import { createTestDatabase, type TestDatabase } from '../support/database.js';
import { uniqueId } from '../support/env.js';
import { insertJob } from '../support/execution.js';

// A run the dispatcher created ahead, in time, that no worker could claim until more than the
// misfire threshold after it was due (the cluster was down, or cut off from PostgreSQL): its job's
// misfire policy decides at the claim, as the dispatcher's does for occurrences it finds late.
// The end-to-end case (a whole cluster killed and started again) is in misfire-outage.test.ts.

const THRESHOLD_MS = 5000;
let db: TestDatabase;
const options: ClaimOptions = {
  nodeId: 'w1',
  graceMs: 3000,
  skewToleranceMs: 10,
  misfireThresholdMs: THRESHOLD_MS,
};

/** The epoch of the leader that made the runs ahead; a newer one leads now (the fence's token). */
const OLD_EPOCH = 1;

before(async () => {
  db = await createTestDatabase();
  await db.pool.query('UPDATE leader_fence SET token = $1', [OLD_EPOCH + 1]);
});
after(() => db.drop());
afterEach(() => db.pool.query('DELETE FROM jobs'));

async function job(
  misfire: 'skip' | 'fire-once' | 'fire-all',
  nextRunAgoMs: number | null = null,
): Promise<string> {
  const id = await insertJob(db.pool, {
    name: `misfire-${uniqueId()}`,
    schedule: '* * * * * *',
    target: { url: 'http://127.0.0.1:9/' },
    nextRunAt: new Date(0),
    timeoutMs: 5000,
  });
  // next_run_at: the first occurrence not made into a run; by default one in the future.
  await db.pool.query(
    `UPDATE jobs SET misfire = $2,
                     next_run_at = now() - coalesce($3, -60000) * interval '1 millisecond' WHERE id = $1`,
    [id, misfire, nextRunAgoMs],
  );
  return id;
}

interface RunSpec {
  agoMs: number;
  attempt?: number;
  trigger?: 'schedule' | 'manual';
  /** Started once (a retry's first call); default never. */
  startedAt?: boolean;
  /** Created this long after it was due (a catch-up); default 3 s ahead, as the dispatcher does. */
  createdLateMs?: number;
  /** The run's copy of its job's policy; default the job's when the run was made. */
  misfire?: string;
  /** The epoch that made it; default OLD_EPOCH (null: made through the API). */
  epoch?: number | null;
}

/** A queued run of `jobId` due `agoMs` ago. */
async function run(jobId: string, spec: RunSpec): Promise<string> {
  const { rows } = await db.pool.query<{ id: string }>(
    `INSERT INTO runs (job_id, scheduled_for, trigger, state, attempt, max_attempts, target, timeout_ms,
                       backoff_ms, backoff_multiplier, not_before, started_at, created_at, misfire,
                       created_epoch)
     SELECT id, now() - $2 * interval '1 millisecond', $3, 'queued', $4, 3, target, timeout_ms, 0, 1,
            now() - $2 * interval '1 millisecond', CASE WHEN $5 THEN now() - interval '1 minute' END,
            now() - ($2 - $6) * interval '1 millisecond', coalesce($7, misfire), $8
     FROM jobs WHERE id = $1 RETURNING id`,
    [
      jobId,
      spec.agoMs,
      spec.trigger ?? 'schedule',
      spec.attempt ?? 0,
      spec.startedAt ?? false,
      spec.createdLateMs ?? -3000,
      spec.misfire ?? null,
      spec.epoch === undefined ? OLD_EPOCH : spec.epoch,
    ],
  );
  return rows[0]!.id;
}

async function outcome(runId: string): Promise<string> {
  const { rows } = await db.pool.query<{ state: string; reason: string | null }>(
    'SELECT state, reason FROM runs WHERE id = $1',
    [runId],
  );
  const row = rows[0]!;
  return row.reason ? `${row.state} (${row.reason})` : row.state;
}

/** The worker's Kafka path: a claim of the announced run, and what a miss means (run-claimer.ts). */
async function claimAnnounced(
  runId: string,
  attempt: number,
  threshold = THRESHOLD_MS,
  ended: EndedEpochsReading | null = null,
) {
  const metrics = createMetrics('test');
  const endedEpochs = () => ended;
  const claimer = new RunClaimer({
    pool: db.pool,
    claim: async (request) =>
      (await claimRuns(db.pool, [request], { ...options, misfireThresholdMs: threshold, endedEpochs }))[0] ??
      'missed',
    skewToleranceMs: 10,
    claimLeadMs: 0,
    misfireThresholdMs: threshold,
    endedEpochs,
    clock: new DbClock(),
    metrics,
  });
  const result = await claimer.claim(
    { runId, jobId: 'unused', attempt: attempt + 1, scheduledFor: new Date(), notBefore: new Date() },
    { retries: 0, early: false },
  );
  const skipped = (await metrics.runsSkipped.get()).values.find((v) => v.labels.reason === 'misfire');
  return { kind: result.kind, misfiresSkipped: skipped?.value ?? 0 };
}

test('a worker skips a late occurrence no worker had claimed, of a `skip` job; on time, or for `fire-all`, it is claimed', async () => {
  const skip = await job('skip');
  const late = await run(skip, { agoMs: 8000 });
  const onTime = await run(skip, { agoMs: 3000 });
  const all = await job('fire-all');
  const lateAll = await run(all, { agoMs: 8000 });

  assert.deepEqual(await claimAnnounced(late, 0), { kind: 'done', misfiresSkipped: 1 });
  assert.equal(await outcome(late), 'skipped (misfire)');
  assert.equal((await claimAnnounced(onTime, 0)).kind, 'claimed');
  assert.equal((await claimAnnounced(lateAll, 0)).kind, 'claimed', 'fire-all fires every missed occurrence');
});

test('`fire-once` keeps the latest late occurrence: older ones are skipped while a later late one exists, or while the dispatcher has later ones to make', async () => {
  const once = await job('fire-once');
  const oldest = await run(once, { agoMs: 12_000 });
  const older = await run(once, { agoMs: 9000 });
  const latest = await run(once, { agoMs: 7000 });
  const onTime = await run(once, { agoMs: 1000 });
  assert.deepEqual(await claimAnnounced(older, 0), { kind: 'done', misfiresSkipped: 1 });
  assert.equal((await claimAnnounced(latest, 0)).kind, 'claimed', 'the latest late occurrence fires');
  assert.equal((await claimAnnounced(onTime, 0)).kind, 'claimed');
  assert.deepEqual(await claimAnnounced(oldest, 0), { kind: 'done', misfiresSkipped: 1 });
  assert.deepEqual([await outcome(oldest), await outcome(older)], ['skipped (misfire)', 'skipped (misfire)']);

  // The only late run so far, but the job's next occurrence not yet made into a run is late too:
  // the dispatcher fires that one (the latest missed), so this one is skipped, whichever comes first.
  const behind = await job('fire-once', 6000);
  const lone = await run(behind, { agoMs: 8000 });
  assert.deepEqual(await claimAnnounced(lone, 0), { kind: 'done', misfiresSkipped: 1 });
  // Paused, the dispatcher makes nothing: the lone late run is the latest missed and fires.
  const paused = await job('fire-once', 6000);
  await db.pool.query('UPDATE jobs SET enabled = false WHERE id = $1', [paused]);
  assert.equal((await claimAnnounced(await run(paused, { agoMs: 8000 }), 0)).kind, 'claimed');
});

test('a retry, a manual run and a claim given back uncalled are owed: claimed however late, whatever the policy', async () => {
  const skip = await job('skip');
  const retry = await run(skip, { agoMs: 60_000, attempt: 1, startedAt: true });
  const manual = await run(skip, { agoMs: 60_000, trigger: 'manual' });
  // Claimed ahead, never started, forgiven by the reaper (or handed back): a frozen worker is not
  // the cluster being down.
  const givenBack = await run(skip, { agoMs: 60_000, attempt: 1 });
  for (const [id, attempt] of [
    [retry, 1],
    [manual, 0],
    [givenBack, 1],
  ] as const)
    assert.equal((await claimAnnounced(id, attempt)).kind, 'claimed', await outcome(id));
});

test("the policy is the run's copy of its job's, and a run its creator made late (a catch-up) is the creator's to fire", async () => {
  // Made in time while the job was `skip`; the job was edited to fire-all since: still dropped.
  const edited = await job('fire-all');
  assert.deepEqual(await claimAnnounced(await run(edited, { agoMs: 8000, misfire: 'skip' }), 0), {
    kind: 'done',
    misfiresSkipped: 1,
  });
  // Made while fire-all, the job edited to skip since: fired, as the job was defined then.
  const toSkip = await job('skip');
  assert.equal(
    (await claimAnnounced(await run(toSkip, { agoMs: 8000, misfire: 'fire-all' }), 0)).kind,
    'claimed',
  );
  // Made 6 s after it was due (the dispatcher's or an edit's catch-up, which applied the policy).
  const caughtUp = await run(await job('skip'), { agoMs: 8000, createdLateMs: 6000 });
  assert.equal((await claimAnnounced(caughtUp, 0)).kind, 'claimed');
  // A catch-up's run left unclaimed through a second outage: late again from when it was made.
  const stale = await run(await job('skip'), { agoMs: 70_000, createdLateMs: 6000 });
  assert.deepEqual(await claimAnnounced(stale, 0), { kind: 'done', misfiresSkipped: 1 });
  // fire-once keeps its latest late run unless the later one does not fire in its place: a later
  // run that copied `skip`, or a dispatcher catch-up under a job now `skip`.
  const switched = await job('fire-once', 6000);
  await db.pool.query(`UPDATE jobs SET misfire = 'skip' WHERE id = $1`, [switched]);
  const kept = await run(switched, { agoMs: 9000, misfire: 'fire-once' });
  await run(switched, { agoMs: 7000, misfire: 'skip' });
  assert.equal((await claimAnnounced(kept, 0)).kind, 'claimed', 'nothing later fires in its place');
  // Rows from before runs had the column: the job's policy.
  const legacy = await job('skip');
  const old = await run(legacy, { agoMs: 8000 });
  await db.pool.query('UPDATE runs SET misfire = NULL WHERE id = $1', [old]);
  assert.deepEqual(await claimAnnounced(old, 0), { kind: 'done', misfiresSkipped: 1 });
});

test('a run whose leader still leads (a worker blocked, Kafka away, a saturated cluster) is delayed, not dropped; so is one made through the API', async () => {
  const skip = await job('skip');
  const sameEpoch = await run(skip, { agoMs: 60_000, epoch: OLD_EPOCH + 1 });
  const madeByCommand = await run(skip, { agoMs: 8000, createdLateMs: 0, epoch: null });
  assert.equal((await claimAnnounced(sameEpoch, 0)).kind, 'claimed');
  assert.equal((await claimAnnounced(madeByCommand, 0)).kind, 'claimed');
});

test('without a threshold (an older caller) nothing is dropped at the claim', async () => {
  const late = await run(await job('skip'), { agoMs: 60_000 });
  const [claimed] = await claimRuns(db.pool, [{ runId: late, expectedAttempt: null }], {
    ...options,
    misfireThresholdMs: undefined,
  });
  assert.equal(claimed?.id, late);
});

test("a run that crosses the threshold between the poll's select and its claim is skipped as a misfire, not as a forbid skip", async () => {
  // Due 4.8 s ago when selected (not yet a misfire); the claim comes 400 ms later.
  const crossing = await run(await job('skip'), { agoMs: THRESHOLD_MS - 200 });
  const result = await inTransaction(db.pool, async (client) => {
    const query = client.query.bind(client) as (...args: unknown[]) => Promise<unknown>;
    const slowed = new Proxy(client, {
      get: (target, property) =>
        property !== 'query'
          ? (Reflect.get(target, property) as unknown)
          : async (...args: unknown[]) => {
              const answer = await query(...args);
              if (String(args[0]).includes('FOR UPDATE OF r SKIP LOCKED')) await sleep(400);
              return answer;
            },
    });
    return claimOverdueRuns(slowed, 2000, 10, options);
  });
  assert.deepEqual(
    { claimed: result.claimed.length, skipped: result.skipped, misfired: result.misfired },
    {
      claimed: 0,
      skipped: 0,
      misfired: 1,
    },
  );
  assert.equal(await outcome(crossing), 'skipped (misfire)');
});

test('the polling fallback skips the misfires it selects and claims the rest', async () => {
  const skip = await job('skip');
  const late = [await run(skip, { agoMs: 9000 }), await run(skip, { agoMs: 8000 })];
  const owed = await run(skip, { agoMs: 9000, trigger: 'manual' });
  const result = await inTransaction(db.pool, (client) => claimOverdueRuns(client, 2000, 10, options));
  assert.equal(result.misfired, 2);
  assert.deepEqual(
    result.claimed.map((r) => r.id),
    [owed],
  );
  assert.deepEqual(await Promise.all(late.map(outcome)), ['skipped (misfire)', 'skipped (misfire)']);
});

test("etcd's word that the run's epoch ended counts before the fence has moved, read from the fence's own leader key; a live leader's runs are still only delayed", async (t) => {
  // The fence holds OLD_EPOCH + 1, written from the leader key KEY: by the fence alone, runs of that
  // epoch are its leader's, still leading.
  const KEY = 'cluster-1/helios/leader';
  await db.pool.query('UPDATE leader_fence SET leader_key = $1', [KEY]);
  t.after(() => db.pool.query('UPDATE leader_fence SET leader_key = NULL'));
  const live = OLD_EPOCH + 1;
  const skip = await job('skip');
  const late = () => run(skip, { agoMs: 8000, epoch: live });
  // etcd: the leader key is held with that token (it leads), or etcd was reset and its revisions
  // are lower than the fence: nothing more is known to have ended.
  const held = await late();
  assert.equal(
    (await claimAnnounced(held, 0, THRESHOLD_MS, { below: BigInt(live), leaderKey: KEY })).kind,
    'claimed',
  );
  const afterReset = await late();
  assert.equal(
    (await claimAnnounced(afterReset, 0, THRESHOLD_MS, { below: 1n, leaderKey: KEY })).kind,
    'claimed',
  );
  // A worker reading another etcd or another prefix ("no leader" there): its tokens say nothing
  // of this fence's, and the live leader's runs are not dropped.
  for (const other of ['cluster-2/helios/leader', 'cluster-1/helios-typo/leader']) {
    const id = await late();
    assert.equal(
      (await claimAnnounced(id, 0, THRESHOLD_MS, { below: BigInt(live + 100), leaderKey: other })).kind,
      'claimed',
      other,
    );
  }
  // etcd: no leader key, or a newer one: that epoch has ended, though no new leader has written.
  const ended = { below: BigInt(live + 1), leaderKey: KEY };
  const orphan = await late();
  assert.deepEqual(await claimAnnounced(orphan, 0, THRESHOLD_MS, ended), {
    kind: 'done',
    misfiresSkipped: 1,
  });
  assert.equal(await outcome(orphan), 'skipped (misfire)');
  // The polling fallback the same.
  const polled = await run(skip, { agoMs: 9000, epoch: live });
  const result = await inTransaction(db.pool, (client) =>
    claimOverdueRuns(client, 2000, 10, { ...options, endedEpochs: () => ended }),
  );
  assert.equal(result.misfired, 1);
  assert.equal(await outcome(polled), 'skipped (misfire)');
});
