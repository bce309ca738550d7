import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { LeaderElection, type Leadership } from '../../src/coordination/election.js';
import { NodeRegistry } from '../../src/coordination/registry.js';
import { CLUSTER_COUNT_CAP } from '../../src/observability/cluster-signals.js';
import { silentLogger } from '../../src/observability/logger.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';

let api: TestApi;
before(async () => {
  api = await startTestApi();
});
after(() => api.close());

interface Cluster {
  leader: { nodeId: string; fencingToken: number; since: string } | null;
  nodes: {
    id: string;
    host: string;
    pid: number;
    apiUrl: string | null;
    roles: string[];
    lastSeen: string;
  }[];
  outbox: { pending: number; oldestDueAgeSeconds: number };
  runs: { queued: number; overdue: number; waitingForbid: number; running: number };
  deadLetters: { open: number };
}

test('GET /cluster shows the leader and its fencing token, live nodes, outbox, run and dead-letter counts', async () => {
  const empty = await api.call('GET', '/api/v1/cluster');
  assert.equal(empty.status, 200);
  assert.deepEqual(empty.body, {
    leader: null,
    nodes: [],
    outbox: { pending: 0, oldestDueAgeSeconds: 0 },
    runs: { queued: 0, overdue: 0, waitingForbid: 0, running: 0 },
    deadLetters: { open: 0 },
  });

  const registry = new NodeRegistry({
    client: api.etcd,
    prefix: api.etcdPrefix,
    info: {
      id: 'cluster-n1',
      host: 'h1',
      pid: 4242,
      apiUrl: 'http://127.0.0.1:1',
      roles: ['api', 'scheduler'],
    },
    logger: silentLogger,
  });
  let elected!: (leadership: Leadership) => void;
  const leading = new Promise<Leadership>((resolve) => (elected = resolve));
  const election = new LeaderElection({
    client: api.etcd,
    key: `${api.etcdPrefix}/leader`,
    nodeId: 'cluster-n1',
    ttlMs: 3000,
    safetyMarginMs: 500,
    logger: silentLogger,
    onElected: (leadership) => elected(leadership),
  });
  await registry.start();
  election.start();
  try {
    const leadership = await leading;
    const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('cluster-job') })).body as {
      id: string;
    };
    await api.call('POST', `/api/v1/jobs/${job.id}/trigger`);
    await api.db.pool.query(
      `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms,
                         backoff_ms, backoff_multiplier, not_before)
       SELECT id, now() - interval '1 hour', 'running', 1, 3, target, 1000, 0, 1, now() FROM jobs WHERE id = $1`,
      [job.id],
    );
    // Overdue: queued and due longer ago than the misfire threshold (5 s), unlike the trigger's run.
    // An open dead letter, and one replayed (not counted). An outbox row due 30 s ago, one not yet due.
    await api.db.pool.query(
      `WITH overdue AS (
         INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms,
                           backoff_ms, backoff_multiplier, not_before)
         SELECT id, now() - interval '2 hours', 'queued', 1, 3, target, 1000, 0, 1, now() - interval '10 seconds'
         FROM jobs WHERE id = $1 RETURNING id),
       dead AS (
         INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms,
                           backoff_ms, backoff_multiplier, not_before, finished_at)
         SELECT id, now() - g * interval '3 hours', 'dead', 3, 3, target, 1000, 0, 1, now(), now()
         FROM jobs, generate_series(1, 2) g WHERE id = $1 RETURNING id, job_id)
       INSERT INTO dead_letters (run_id, job_id, attempt, replayed_at)
       SELECT id, job_id, 3, CASE WHEN row_number() OVER (ORDER BY id) = 1 THEN now() END FROM dead`,
      [job.id],
    );
    // A forbid job's retry, overdue, waiting for the job's running run: waiting, not overdue.
    const forbid = (
      await api.call('POST', '/api/v1/jobs', { body: jobBody('cluster-forbid', { concurrency: 'forbid' }) })
    ).body as { id: string };
    await api.db.pool.query(
      `INSERT INTO runs (job_id, scheduled_for, state, attempt, max_attempts, target, timeout_ms,
                         backoff_ms, backoff_multiplier, concurrency, not_before)
       SELECT id, now() - interval '1 hour' - g * interval '1 minute', s, 1, 3, target, 1000, 0, 1, 'forbid',
              now() - interval '10 seconds'
       FROM jobs, unnest(ARRAY['running', 'queued']) WITH ORDINALITY AS u (s, g) WHERE id = $1`,
      [forbid.id],
    );
    await api.db.pool.query(
      `INSERT INTO outbox (topic, key, payload, publish_after)
       VALUES ('helios.runs', 'k', '{}', now() - interval '30 seconds'), ('helios.runs', 'k', '{}', now() + interval '1 hour')`,
    );
    const response = await api.call('GET', '/api/v1/cluster');
    assert.equal(response.status, 200);
    const cluster = response.body as Cluster;
    assert.equal(cluster.leader?.nodeId, 'cluster-n1');
    assert.equal(cluster.leader?.fencingToken, Number(leadership.token));
    assert.ok(!Number.isNaN(Date.parse(cluster.leader!.since)));
    assert.deepEqual(
      cluster.nodes.map((n) => [n.id, n.host, n.pid, n.apiUrl, n.roles]),
      [['cluster-n1', 'h1', 4242, 'http://127.0.0.1:1', ['api', 'scheduler']]],
    );
    assert.equal(cluster.outbox.pending, 3, "the trigger's announcement and the two rows above");
    assert.ok(
      cluster.outbox.oldestDueAgeSeconds >= 30 && cluster.outbox.oldestDueAgeSeconds < 40,
      `oldest due outbox row waited ${cluster.outbox.oldestDueAgeSeconds} s`,
    );
    assert.deepEqual(cluster.runs, { queued: 3, overdue: 1, waitingForbid: 1, running: 2 });
    assert.deepEqual(cluster.deadLetters, { open: 1 });
  } finally {
    await api.db.pool.query(`DELETE FROM outbox`);
    await election.stop();
    await registry.stop();
  }
  const after = (await api.call('GET', '/api/v1/cluster')).body as Cluster;
  assert.equal(after.leader, null);
  assert.deepEqual(after.nodes, []);
});

test('GET /cluster answers 503 problem when etcd does not answer', async () => {
  const blind = await startTestApi({ db: api.db, etcdEndpoints: ['http://127.0.0.1:1'] });
  try {
    const response = await blind.call('GET', '/api/v1/cluster');
    assert.equal(response.status, 503);
    assert.match(response.headers.get('content-type') ?? '', /problem\+json/);
    assert.match(JSON.stringify(response.body), /etcd/);
  } finally {
    await blind.close();
  }
});

test('GET /cluster stops each count at the cap, so a huge backlog costs a call no more than the cap', async () => {
  const job = (await api.call('POST', '/api/v1/jobs', { body: jobBody('cluster-backlog') })).body as {
    id: string;
  };
  await api.db.pool.query(`DELETE FROM runs`); // the test before left one running
  const over = CLUSTER_COUNT_CAP + 1;
  await api.db.pool.query(
    `INSERT INTO outbox (topic, key, payload) SELECT 'helios.runs', 'k', '{}' FROM generate_series(1, $1)`,
    [over],
  );
  await api.db.pool.query(
    `INSERT INTO runs (job_id, scheduled_for, state, max_attempts, target, timeout_ms, backoff_ms,
                       backoff_multiplier, not_before)
     SELECT j.id, now() + s * interval '1 second', 'queued', 3, j.target, 1000, 0, 1, now() + interval '1 hour'
     FROM jobs j, generate_series(1, $2) s WHERE j.id = $1`,
    [job.id, over],
  );
  try {
    const response = await api.call('GET', '/api/v1/cluster');
    assert.equal(response.status, 200);
    const cluster = response.body as Cluster;
    assert.equal(cluster.outbox.pending, CLUSTER_COUNT_CAP);
    assert.deepEqual(cluster.runs, { queued: CLUSTER_COUNT_CAP, overdue: 0, waitingForbid: 0, running: 0 });
  } finally {
    await api.db.pool.query(`DELETE FROM outbox`);
    await api.call('DELETE', `/api/v1/jobs/${job.id}`);
  }
});
