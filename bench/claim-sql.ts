/**
 * CPU of the execution phase's SQL alone: 10,000 queued runs due now, claimed in batches of 256
 * (the worker's claim statement, store/runs.ts) and completed in batches of 256 (the completion
 * statement, store/attempts.ts), one connection, no HTTP. With --ahead, the runs are due in 30 s
 * and claimed ahead of their time, as a herd's are, and a start phase marks them started (the
 * statement a worker runs just before the calls, store/runs.ts startRuns) before they are
 * completed. Prints, per phase, the CPU of the
 * PostgreSQL backend (from /proc/<pid>/stat, so it does not depend on the machine's load the way
 * wall time does) and of this process (pg's serialising and parsing), in µs per run; and the WAL
 * bytes written per run, and the share of the phase's updates of `runs` that were HOT. Use it for an A/B of a change to those statements or to the runs indexes.
 *
 *   npx tsx bench/claim-sql.ts [--runs 10000] [--batch 256] [--repeat 3] [--ahead] [--fillfactor N]
 */
import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { completeSucceededMany } from '../src/store/attempts.js';
import { claimRuns, startRuns } from '../src/store/runs.js';
import { createTestDatabase } from '../test/support/database.js';
import { median } from './lib/stats.js';

function cpuSecondsOf(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return (Number(fields[11]) + Number(fields[12])) / 100;
}

interface Phase {
  backendUs: number;
  clientUs: number;
  walBytes: number;
  /** Of the phase's updates of `runs`, the share that were HOT (no index entry written). */
  hotShare: number;
}

interface Phases {
  claim: Phase;
  start?: Phase;
  complete: Phase;
}

async function once(runs: number, batch: number, ahead: boolean, fillfactor?: number): Promise<Phases> {
  const db = await createTestDatabase();
  const client = await db.pool.connect();
  try {
    if (fillfactor !== undefined) await client.query(`ALTER TABLE runs SET (fillfactor = ${fillfactor})`);
    await client.query(
      `INSERT INTO jobs (name, schedule, target, timeout_ms, max_attempts)
       SELECT 'sql-' || n, '0 0 * * *', '{"url":"http://127.0.0.1:9/tick","method":"POST","body":{"bench":true}}', 5000, 3
       FROM generate_series(1, $1) AS n`,
      [runs],
    );
    const { rows } = await client.query<{ id: string }>(
      `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                         backoff_multiplier, concurrency, not_before)
       SELECT id, date_trunc('second', now()), 'queued', max_attempts, target, timeout_ms, backoff_ms,
              backoff_multiplier, concurrency, now() + $1 * interval '1 millisecond'
       FROM jobs RETURNING id`,
      [ahead ? 30_000 : -1000],
    );
    await client.query('VACUUM ANALYZE runs');
    await client.query('VACUUM ANALYZE run_attempts');
    const pid = (await client.query<{ pid: number }>('SELECT pg_backend_pid() AS pid')).rows[0]!.pid;
    const wal = async () =>
      Number(
        (
          await client.query<{ lsn: string }>('SELECT pg_current_wal_insert_lsn() - $1::pg_lsn AS lsn', [
            '0/0',
          ])
        ).rows[0]!.lsn,
      );
    const ids = rows.map((r) => r.id);
    const options = { nodeId: 'bench-node', graceMs: 5000, skewToleranceMs: 10, leadMs: ahead ? 60_000 : 50 };

    // This backend's own counters, flushed on demand (PostgreSQL 15 batches them otherwise).
    const updates = async () => {
      await client.query('SELECT pg_stat_force_next_flush()');
      await client.query('SELECT pg_stat_clear_snapshot()');
      const { rows: stats } = await client.query<{ upd: string; hot: string }>(
        "SELECT n_tup_upd AS upd, n_tup_hot_upd AS hot FROM pg_stat_user_tables WHERE relname = 'runs'",
      );
      return { all: Number(stats[0]!.upd), hot: Number(stats[0]!.hot) };
    };
    const measure = async (work: () => Promise<void>): Promise<Phase> => {
      const updates0 = await updates();
      const backend0 = cpuSecondsOf(pid);
      const client0 = process.cpuUsage();
      const wal0 = await wal();
      await work();
      const used = process.cpuUsage(client0);
      const backendUs = ((cpuSecondsOf(pid) - backend0) * 1e6) / runs;
      const walBytes = ((await wal()) - wal0) / runs;
      const updates1 = await updates();
      const updated = updates1.all - updates0.all;
      return {
        backendUs,
        clientUs: (used.user + used.system) / runs,
        walBytes,
        hotShare: updated === 0 ? 0 : (updates1.hot - updates0.hot) / updated,
      };
    };
    const claimed: { id: string; attempt: number }[] = [];
    const claim = await measure(async () => {
      for (let i = 0; i < ids.length; i += batch) {
        const got = await claimRuns(
          client,
          ids.slice(i, i + batch).map((runId) => ({ runId, expectedAttempt: 1 })),
          options,
        );
        for (const run of got) if (run) claimed.push({ id: run.id, attempt: run.attempt });
      }
    });
    if (claimed.length !== runs) throw new Error(`claimed ${claimed.length} of ${runs}`);
    const start = ahead
      ? await measure(async () => {
          for (let i = 0; i < claimed.length; i += batch) {
            const started = await startRuns(client, 'bench-node', claimed.slice(i, i + batch));
            if (started.some((s) => !s)) throw new Error('a start was refused');
          }
        })
      : undefined;
    const report = {
      outcome: 'succeeded' as const,
      statusCode: 200,
      durationMs: 1.5,
      error: null,
      responseExcerpt: 'ok',
    };
    const complete = await measure(async () => {
      for (let i = 0; i < claimed.length; i += batch) {
        const done = await completeSucceededMany(
          client,
          'bench-node',
          claimed.slice(i, i + batch).map((run) => ({ run, report })),
        );
        if (done.some((d) => !d)) throw new Error('a completion was refused');
      }
    });
    return { claim, start, complete };
  } finally {
    client.release();
    await db.drop();
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      runs: { type: 'string', default: '10000' },
      batch: { type: 'string', default: '256' },
      repeat: { type: 'string', default: '3' },
      ahead: { type: 'boolean', default: false },
      fillfactor: { type: 'string' },
    },
  });
  const runs = Number(values.runs);
  const batch = Number(values.batch);
  const results: Phases[] = [];
  for (let i = 0; i < Number(values.repeat); i++) {
    const fillfactor = values.fillfactor === undefined ? undefined : Number(values.fillfactor);
    const r = await once(runs, batch, values.ahead, fillfactor);
    results.push(r);
    const line = (p: Phase) =>
      `backend ${p.backendUs.toFixed(0)} µs, client ${p.clientUs.toFixed(0)} µs, WAL ${p.walBytes.toFixed(0)} B, ` +
      `HOT ${(p.hotShare * 100).toFixed(0)}%`;
    const start = r.start ? ` | start ${line(r.start)}` : '';
    console.log(`run ${i + 1}: claim ${line(r.claim)}${start} | complete ${line(r.complete)} (per run)`);
  }
  const m = (pick: (r: Phases) => number) => median(results.map(pick)).toFixed(0);
  const phases: ['claim' | 'start' | 'complete', (r: Phases) => Phase][] = [
    ['claim', (r) => r.claim],
    ...(values.ahead ? [['start', (r: Phases) => r.start!] as ['start', (r: Phases) => Phase]] : []),
    ['complete', (r) => r.complete],
  ];
  const each = (what: keyof Phase, unit: string) =>
    phases.map(([name, pick]) => `${name} ${m((r) => pick(r)[what])} ${unit}`).join(' + ');
  console.log(
    `median per run: backend ${each('backendUs', 'µs')}; client ${each('clientUs', 'µs')}; WAL ${each('walBytes', 'B')}`,
  );
}

main().catch((err: unknown) => {
  console.error(err);
  process.exitCode = 1;
});
