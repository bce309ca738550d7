import assert from 'node:assert/strict';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import type { ApiRole } from '../../src/config/index.js';
import { ADMIN, startTestApi, VIEWER, type TestApi } from '../support/api.js';
import { runCli } from '../support/processes.js';

// The real CLI (`dist/main.js`, built by `npm run build`) against a real API server.

let api: TestApi;
let dir: string;
before(async () => {
  api = await startTestApi({
    tokens: new Map<string, ApiRole>([
      [ADMIN, 'admin'],
      [VIEWER, 'viewer'],
    ]),
  });
  dir = await mkdtemp(join(tmpdir(), 'helios-cli-'));
});
after(async () => {
  await api.close();
  await rm(dir, { recursive: true, force: true });
});

function helios(args: string[], env: Record<string, string> = {}) {
  return runCli(args, {
    PATH: process.env.PATH ?? '',
    HELIOS_API_URL: api.url,
    HELIOS_API_TOKEN: ADMIN,
    ...env,
  });
}

async function jobFile(name: string, job: unknown): Promise<string> {
  const path = join(dir, name);
  await writeFile(path, JSON.stringify(job, null, 2));
  return path;
}

const nightly = {
  name: 'cli-nightly',
  schedule: '0 3 * * *',
  timezone: 'Europe/Berlin',
  target: { url: 'http://127.0.0.1:9/report', method: 'POST', body: { kind: 'nightly' } },
  retry: { maxAttempts: 5, backoffMs: 2000 },
};

async function storedJob(name: string) {
  const { rows } = await api.db.pool.query('SELECT * FROM jobs WHERE name = $1', [name]);
  return rows;
}

test('apply twice is idempotent: created, then unchanged, with one job and no write', async () => {
  const file = await jobFile('nightly.json', nightly);
  const first = await helios(['jobs', 'apply', '-f', file]);
  assert.equal(first.code, 0, first.stderr);
  assert.equal(first.stdout.trim(), 'job cli-nightly created');
  const afterFirst = await storedJob('cli-nightly');

  const second = await helios(['jobs', 'apply', '-f', file]);
  assert.equal(second.code, 0, second.stderr);
  assert.equal(second.stdout.trim(), 'job cli-nightly unchanged');
  const afterSecond = await storedJob('cli-nightly');
  assert.equal(afterSecond.length, 1);
  assert.deepEqual(afterSecond, afterFirst, 'not even updated_at moved');
});

test('apply updates a changed file, resets omitted fields to defaults, and keeps a manual pause', async () => {
  const file = await jobFile('nightly.json', { ...nightly, schedule: '30 4 * * *', timeoutMs: 9000 });
  assert.equal((await helios(['jobs', 'apply', '-f', file])).stdout.trim(), 'job cli-nightly updated');
  let [row] = await storedJob('cli-nightly');
  assert.equal(row.schedule, '30 4 * * *');
  assert.equal(row.timeout_ms, 9000);

  await helios(['jobs', 'pause', 'cli-nightly']);
  await jobFile('nightly.json', { ...nightly, schedule: '30 4 * * *' });
  assert.equal((await helios(['jobs', 'apply', '-f', file])).stdout.trim(), 'job cli-nightly updated');
  [row] = await storedJob('cli-nightly');
  assert.equal(row.timeout_ms, 30_000, 'an omitted field goes back to its default');
  assert.equal(row.enabled, false, 'a file without "enabled" does not resume a paused job');
  assert.equal((await helios(['jobs', 'apply', '-f', file])).stdout.trim(), 'job cli-nightly unchanged');
});

test('apply takes a folder of job files; --json reports each outcome', async () => {
  const folder = join(dir, 'jobs');
  await rm(folder, { recursive: true, force: true });
  await mkdir(folder);
  await writeFile(join(folder, 'a.json'), JSON.stringify({ ...nightly, name: 'cli-folder-a' }));
  await writeFile(join(folder, 'b.json'), JSON.stringify([{ ...nightly, name: 'cli-folder-b' }]));
  await writeFile(join(folder, 'notes.txt'), 'ignored');
  const first = await helios(['jobs', 'apply', '-f', folder, '--json']);
  assert.equal(first.code, 0, first.stderr);
  const outcomes = (JSON.parse(first.stdout) as { outcome: string; job: { name: string } }[]).map((r) => [
    r.job.name,
    r.outcome,
  ]);
  assert.deepEqual(outcomes, [
    ['cli-folder-a', 'created'],
    ['cli-folder-b', 'created'],
  ]);
  const again = JSON.parse((await helios(['jobs', 'apply', '-f', folder, '--json'])).stdout) as {
    outcome: string;
  }[];
  assert.deepEqual(
    again.map((r) => r.outcome),
    ['unchanged', 'unchanged'],
  );
});

test('create with a bad file prints the problem title and the failing field, and exits non-zero', async () => {
  const bad = await jobFile('bad.json', { ...nightly, name: 'cli-bad', schedule: '99 * * * *' });
  const result = await helios(['jobs', 'create', '-f', bad]);
  assert.equal(result.code, 1);
  assert.match(result.stderr, /Invalid request/);
  assert.match(result.stderr, /^\s+schedule: /m);
  assert.equal(result.stdout, '');
  assert.equal((await storedJob('cli-bad')).length, 0);

  const notJson = join(dir, 'broken.json');
  await writeFile(notJson, '{ "name": ');
  const broken = await helios(['jobs', 'create', '-f', notJson]);
  assert.equal(broken.code, 1);
  assert.match(broken.stderr, /broken\.json/);

  const missing = await helios(['jobs', 'create']);
  assert.equal(missing.code, 2);
  assert.match(missing.stderr, /-f FILE/);
});

test('create, get, list, trigger, runs, run, pause, resume, delete, dead-letters and cluster work for people and scripts', async () => {
  const file = await jobFile('smoke.json', {
    ...nightly,
    name: 'cli-smoke',
    target: { ...nightly.target, headers: { Authorization: 'Bearer cli-secret' } },
  });
  const created = await helios(['jobs', 'create', '-f', file]);
  assert.equal(created.code, 0, created.stderr);
  assert.match(created.stdout, /^created job cli-smoke \(/);

  const got = await helios(['jobs', 'get', 'cli-smoke']);
  assert.match(got.stdout, /schedule\s+0 3 \* \* \*/);
  assert.doesNotMatch(got.stdout, /cli-secret/);
  const gotJson = JSON.parse((await helios(['jobs', 'get', 'cli-smoke', '--json'])).stdout) as { id: string };

  const list = await helios(['jobs', 'list']);
  assert.match(list.stdout.split('\n')[0]!, /^NAME\s+SCHEDULE\s+TIMEZONE/);
  assert.match(list.stdout, /cli-smoke/);
  const listed = JSON.parse((await helios(['jobs', 'list', '--json'])).stdout) as { name: string }[];
  assert.ok(listed.some((j) => j.name === 'cli-smoke'));

  const triggered = JSON.parse((await helios(['jobs', 'trigger', 'cli-smoke', '--json'])).stdout) as {
    runId: string;
  };
  const runs = await helios(['runs', 'cli-smoke']);
  assert.match(runs.stdout, new RegExp(triggered.runId));
  assert.match(runs.stdout, /manual\s+queued/);
  const run = await helios(['run', triggered.runId]);
  assert.equal(run.code, 0, run.stderr);
  assert.match(run.stdout, /state\s+queued/);

  assert.match((await helios(['jobs', 'pause', gotJson.id])).stdout, /paused/);
  assert.match((await helios(['jobs', 'resume', 'cli-smoke'])).stdout, /resumed, next run/);

  const letters = await helios(['dead-letters', 'list']);
  assert.equal(letters.code, 0, letters.stderr);
  assert.match(letters.stdout, /^ID\s+JOB/);
  const replay = await helios(['dead-letters', 'replay', '00000000-0000-4000-8000-000000000000']);
  assert.equal(replay.code, 1);
  assert.match(replay.stderr, /Not found/);

  const cluster = await helios(['cluster']);
  assert.equal(cluster.code, 0, cluster.stderr);
  assert.match(cluster.stdout, /^leader: none/);
  assert.match(
    cluster.stdout,
    /runs queued: 1 {3}overdue: [01] {3}waiting \(forbid\): 0 {3}running: 0 {3}dead letters open: 0/,
  );
  assert.match(cluster.stdout, /outbox pending: \d+ {3}oldest due waited: \d+\.\d s/);
  const clusterJson = JSON.parse((await helios(['cluster', '--json'])).stdout) as {
    runs: { queued: number };
  };
  assert.equal(clusterJson.runs.queued, 1);

  assert.match((await helios(['jobs', 'delete', 'cli-smoke'])).stdout, /deleted job cli-smoke/);
  const gone = await helios(['jobs', 'get', 'cli-smoke']);
  assert.equal(gone.code, 1);
  assert.match(gone.stderr, /Not found/);
});

test('auth and connection failures exit 1 with a clear line', async () => {
  const anonymous = await helios(['jobs', 'list'], { HELIOS_API_TOKEN: '' });
  assert.equal(anonymous.code, 1);
  assert.match(anonymous.stderr, /Unauthorized \(HTTP 401\)/);
  const viewer = await helios(['jobs', 'trigger', 'anything'], { HELIOS_API_TOKEN: VIEWER });
  assert.equal(viewer.code, 1);
  assert.match(viewer.stderr, /Forbidden \(HTTP 403\)/);
  const nowhere = await helios(['cluster'], { HELIOS_API_URL: 'http://127.0.0.1:1' });
  assert.equal(nowhere.code, 1);
  assert.match(nowhere.stderr, /cannot reach http:\/\/127\.0\.0\.1:1/);
  const usage = await helios(['jobs', 'frobnicate']);
  assert.equal(usage.code, 2);
  assert.match(usage.stderr, /unknown jobs command/);
});
