/**
 * CPU of the execution phase's SQL alone: 10,000 queued runs due now, claimed in batches of 256
 * (the worker's claim statement, store/runs.ts) and completed in batches of 256 (the completion
 * statement, store/attempts.ts), one connection, no HTTP. Prints, per phase, the CPU of the
 * PostgreSQL backend (from /proc/<pid>/stat, so it does not depend on the machine's load the way
 * wall time does) and of this process (pg's serialising and parsing), in µs per run; and the WAL
 * bytes written per run. Use it for an A/B of a change to those statements or to the runs indexes.
 *
 *   npx tsx bench/claim-sql.ts [--runs 10000] [--batch 256] [--repeat 3]
 */
import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { completeSucceededMany } from '../src/store/attempts.js';
import { claimRuns } from '../src/store/runs.js';
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
}

async function once(runs: number, batch: number): Promise<{ claim: Phase; complete: Phase }> {
  const db = await createTestDatabase();
  const client = await db.pool.connect();
  try {
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
              backoff_multiplier, concurrency, now() - interval '1 second'
       FROM jobs RETURNING id`,
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
    const options = { nodeId: 'bench-node', graceMs: 5000, skewToleranceMs: 10, leadMs: 50 };

    const measure = async (work: () => Promise<void>): Promise<Phase> => {
      const backend0 = cpuSecondsOf(pid);
      const client0 = process.cpuUsage();
      const wal0 = await wal();
      await work();
      const used = process.cpuUsage(client0);
      return {
        backendUs: ((cpuSecondsOf(pid) - backend0) * 1e6) / runs,
        clientUs: (used.user + used.system) / runs,
        walBytes: ((await wal()) - wal0) / runs,
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
    return { claim, complete };
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
    },
  });
  const runs = Number(values.runs);
  const batch = Number(values.batch);
  const results: { claim: Phase; complete: Phase }[] = [];
  for (let i = 0; i < Number(values.repeat); i++) {
    const r = await once(runs, batch);
    results.push(r);
    const line = (p: Phase) =>
      `backend ${p.backendUs.toFixed(0)} µs, client ${p.clientUs.toFixed(0)} µs, WAL ${p.walBytes.toFixed(0)} B`;
    console.log(`run ${i + 1}: claim ${line(r.claim)} | complete ${line(r.complete)} (per run)`);
  }
  const m = (pick: (r: { claim: Phase; complete: Phase }) => number) => median(results.map(pick)).toFixed(0);
  console.log(
    `median per run: claim backend ${m((r) => r.claim.backendUs)} µs + complete backend ${m((r) => r.complete.backendUs)} µs; ` +
      `client ${m((r) => r.claim.clientUs)} + ${m((r) => r.complete.clientUs)} µs; ` +
      `WAL ${m((r) => r.claim.walBytes)} + ${m((r) => r.complete.walBytes)} B`,
  );
}

main().catch((err: unknown) => {
  console.error(err);
  process.exitCode = 1;
});
