// The programmatic API (src/index.ts) on the real servers: a node started in this process, jobs
// managed through makeJobUtils (the routes' validation and commands, no HTTP) and through the
// typed REST client the CLI uses, and the same problems either way.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import {
  ApiClient,
  ApiError,
  loadConfig,
  makeJobUtils,
  ProblemError,
  startNode,
  type HeliosNode,
  type JobUtils,
} from '../../src/index.js';
import { waitFor } from '../support/execution.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { nodeEnvironment } from '../support/processes.js';

let fx: IntegrationFixture;
let node: HeliosNode;
let utils: JobUtils;
let client: ApiClient;

before(async () => {
  fx = await integrationFixture();
  const config = loadConfig({ ...nodeEnvironment('embedded-1', fx.env()), HELIOS_LOG_LEVEL: 'warn' });
  node = await startNode({ config });
  utils = makeJobUtils(config);
  client = new ApiClient({ apiUrl: node.apiUrl!, apiToken: undefined });
});
after(async () => {
  await utils?.release();
  await node?.stop();
  await fx.teardown();
});

test('a job created through makeJobUtils runs on the embedded node and shows in the REST client', async () => {
  const job = await utils.createJob({
    name: 'embedded-job',
    schedule: '0 0 1 1 *',
    target: { url: `${fx.target.url}/embedded`, method: 'POST', body: { from: 'index.ts' } },
  });
  assert.equal(job.name, 'embedded-job');
  assert.equal((await client.getJob('embedded-job')).id, job.id);

  const { runId } = await utils.triggerJob(job.id);
  await waitFor('the triggered call', () => fx.target.requests.find((r) => r.runId === runId), 20_000);
  const run = await waitFor('the run to succeed', async () => {
    const detail = await client.getRun(runId);
    return detail.state === 'succeeded' ? detail : null;
  });
  assert.equal(run.trigger, 'manual');

  const paused = await client.pauseJob('embedded-job');
  assert.equal(paused.enabled, false);
  assert.equal((await utils.resumeJob('embedded-job')).enabled, true);
  assert.equal((await utils.patchJob('embedded-job', { timeoutMs: 1234 })).timeoutMs, 1234);
  await client.deleteJob('embedded-job');
  await assert.rejects(
    utils.getJob(job.id),
    (err: unknown) => err instanceof ProblemError && err.status === 404,
  );
});

test('bad input is the same 400 problem naming the field, from makeJobUtils and from the REST client', async () => {
  const bad = { name: 'bad-job', schedule: 'not a cron', target: { url: `${fx.target.url}/x` } };
  await assert.rejects(
    utils.createJob(bad),
    (err: unknown) =>
      err instanceof ProblemError && err.status === 400 && err.errors?.[0]?.field === 'schedule',
  );
  await assert.rejects(
    client.createJob(bad),
    (err: unknown) =>
      err instanceof ApiError && err.status === 400 && err.problem.errors?.[0]?.field === 'schedule',
  );
  await assert.rejects(
    utils.createJob({ ...bad, schedule: '* * * * *', timeoutMs: 'soon' } as never),
    (err: unknown) => err instanceof ProblemError && err.errors?.[0]?.field === 'timeoutMs',
  );
  assert.equal((await client.listJobs()).length, 0, 'nothing was written');
});
