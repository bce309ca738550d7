import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import {
  createEverySecondJob,
  firstToLead,
  loggedAt as at,
  occurrencesNotRun,
  pauseAndSettle,
} from '../support/every-second-job.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { startTogether } from '../support/start-together.js';
import { FaultProxy } from '../support/fault-proxy.js';
import { fenceToken } from '../support/database.js';

// Review of 8058db5, suspicion 1: the leader is cut off from PostgreSQL with its bytes *held*
// (not dropped): what it had in flight, and what it sends while cut, reach PostgreSQL only when
// the partition heals, as TCP retransmissions deliver them. It steps down (stall watch), the
// other node leads and writes; then the partition heals and the old epoch's held statements
// (BEGIN, the fence UPDATE, a COMMIT) arrive. None of the old epoch's transactions may commit
// after the new epoch's first: a trigger logs every committed fence write in lock order (the fence
// row lock serialises them), and runs carry the epoch that created them.

let fixture: IntegrationFixture;
let proxies: FaultProxy[] = [];

before(async () => {
  fixture = await integrationFixture();
  proxies = await FaultProxy.inFrontOf(fixture.db.url, 2);
  await fixture.db.pool.query(`
    CREATE TABLE review_fence_log (
      seq bigserial PRIMARY KEY, old_token bigint, new_token bigint, node_id text,
      at timestamptz NOT NULL DEFAULT clock_timestamp());
    CREATE FUNCTION review_log_fence() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      INSERT INTO review_fence_log (old_token, new_token, node_id) VALUES (OLD.token, NEW.token, NEW.node_id);
      RETURN NEW;
    END $$;
    CREATE TRIGGER review_log_fence AFTER UPDATE ON leader_fence FOR EACH ROW EXECUTE FUNCTION review_log_fence();`);
});
after(async () => {
  for (const proxy of proxies) await proxy.close();
  await fixture.teardown();
});

test(
  "a leader cut off with its statements held steps down; once healed, its held writes commit nothing after the new leader's",
  { timeout: 150_000 },
  async () => {
    const nodes = await startTogether(
      fixture,
      proxies.map((proxy, i) => ({
        name: `pg-hold-${i + 1}`,
        extra: { HELIOS_DATABASE_URL: proxy.urlFor(fixture.db.url), HELIOS_CLAIM_GRACE_MS: '1000' },
        wait: { worker: true },
      })),
    );
    const leading = await firstToLead(nodes);
    const old = nodes[leading]!;
    const next = nodes[1 - leading]!;
    const oldToken = BigInt(String(old.node.logs.find((l) => l.msg === 'became leader')!.token));
    const job = await createEverySecondJob(next.apiUrl, fixture.target, 'pg-hold');
    await waitFor('two calls before the cut', () => fixture.target.forJob(job.id).length >= 2, 20_000);

    const cutAt = Date.now();
    proxies[leading]!.cut('hold');
    const steppedDown = await old.node.waitForLog((l) => l.msg === 'stepped down', 30_000);
    assert.equal(steppedDown.reason, 'database-unreachable');
    const became = await next.node.waitForLog((l) => l.msg === 'became leader', 20_000);
    const newToken = BigInt(String(became.token));
    await waitFor(
      'the new leader to write',
      async () => (await fenceToken(fixture.db.pool)) === newToken,
      20_000,
    );
    // A few passes of the new leader, then the held bytes of the old one arrive.
    await sleep(2000);
    const healAt = Date.now();
    proxies[leading]!.heal();
    console.log(
      `# cut: old leader (token ${oldToken}) stepped down after ${at(steppedDown) - cutAt} ms; ` +
        `new leader (token ${newToken}) ${at(became) - cutAt} ms after the cut; healed at +${healAt - cutAt} ms`,
    );
    await sleep(8000);
    for (const l of old.node.logs.filter((l) => at(l) >= healAt - 50 && (l.level ?? 0) >= 40))
      console.log(
        `#   old +${at(l) - healAt} ms after heal ${String(l.part ?? '')}: ${l.msg} ${l.err ? JSON.stringify((l.err as { message?: string }).message) : ''}`,
      );

    const paused = await pauseAndSettle(next.apiUrl, fixture.db.pool, job.id);

    // 1. Fence writes, in the order their row lock was taken (= commit order): the token never falls.
    const { rows: log } = await fixture.db.pool.query<{
      seq: string;
      oldToken: string;
      newToken: string;
      nodeId: string;
    }>(
      `SELECT seq::text, old_token::text AS "oldToken", new_token::text AS "newToken", node_id AS "nodeId"
       FROM review_fence_log ORDER BY review_fence_log.seq`,
    );
    const falls = log.filter((r) => BigInt(r.newToken) < BigInt(r.oldToken));
    const byOld = log.filter((r) => BigInt(r.newToken) === oldToken);
    const firstNew = log.findIndex((r) => BigInt(r.newToken) === newToken);
    console.log(
      `# fence log (seq:old→new node): ${log.map((r) => `${r.seq}:${r.oldToken}→${r.newToken} ${r.nodeId}`).join(', ')}`,
    );
    const oldAfterNew = byOld.filter((r) => log.indexOf(r) > firstNew);
    console.log(
      `# fence log: ${log.length} committed writes; old epoch ${byOld.length}, new epoch ${log.filter((r) => BigInt(r.newToken) === newToken).length}`,
    );
    assert.deepEqual(falls, [], 'no committed fence write lowered the token');
    assert.deepEqual(oldAfterNew, [], "no write of the old epoch committed after the new epoch's first");

    // 2. Runs: none created by the old epoch after the new epoch created one.
    const { rows: late } = await fixture.db.pool.query<{ n: number }>(
      `SELECT count(*)::int AS n FROM runs o
       WHERE o.created_epoch = $1
         AND o.created_at > (SELECT min(created_at) FROM runs WHERE created_epoch = $2)`,
      [oldToken.toString(), newToken.toString()],
    );
    assert.equal(late[0]!.n, 0, 'no run of the old epoch created after the new epoch created one');

    // 3. Every occurrence: one run, that ran (misfire skip: a missed one has none).
    const problems = await occurrencesNotRun(fixture.db.pool, fixture.target, job, paused, {
      label: (s) => `${new Date(s).toISOString()} (cut ${s - cutAt >= 0 ? '+' : ''}${s - cutAt} ms)`,
    });
    assert.deepEqual(
      problems,
      [],
      'every occurrence from the job’s creation to its pause has one run that ran',
    );
    const perOccurrence = new Map<string, number>();
    for (const c of fixture.target.forJob(job.id))
      perOccurrence.set(c.scheduledFor, (perOccurrence.get(c.scheduledFor) ?? 0) + 1);
    console.log(
      `# occurrences called twice: ${
        [...perOccurrence]
          .filter(([, n]) => n > 1)
          .map(([s]) => s)
          .join(', ') || 'none'
      }`,
    );
  },
);
