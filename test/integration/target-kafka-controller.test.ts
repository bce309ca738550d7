// Contract item 11 for Kafka's KRaft controllers: no client is configured with their listeners and
// the metadata lists brokers only, but the quorum's description (DescribeQuorum, which a broker
// answers) lists every controller's listeners. The real Kafka of `.helios/env` runs a controller
// listener beside its broker; an embedded node on the real servers must refuse it as a target.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { after, before, test } from 'node:test';
import { loadConfig, startNode, type HeliosNode } from '../../src/index.js';
import { REPO_ROOT } from '../support/env.js';
import { assertRefusedAtExecution } from '../support/refused-target.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import { nodeEnvironment } from '../support/processes.js';

let fx: IntegrationFixture;
let node: HeliosNode;

/** The controller listener's port, as scripts/infra.sh wrote it into `.helios/env`. */
function controllerPort(): number {
  const port =
    process.env.HELIOS_KAFKA_CONTROLLER_PORT ??
    /HELIOS_KAFKA_CONTROLLER_PORT=(\d+)/.exec(readFileSync(`${REPO_ROOT}.helios/env`, 'utf8'))?.[1];
  assert.ok(port, '.helios/env names the KRaft controller port');
  return Number(port);
}

before(async () => {
  fx = await integrationFixture();
  node = await startNode({
    config: loadConfig({ ...nodeEnvironment('kraft-1', fx.env()), HELIOS_LOG_LEVEL: 'warn' }),
  });
});
after(async () => {
  await node?.stop();
  await fx.teardown();
});

test("the KRaft controller's listener is refused as a target, at save and at execution", async () => {
  const port = controllerPort();
  for (const host of ['127.0.0.1', 'localhost', '[::ffff:127.0.0.1]']) {
    const response = await fetch(`${node.apiUrl}/api/v1/jobs`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({
        name: `kraft-${host.replace(/\W/g, '')}`,
        schedule: '0 0 1 1 *',
        target: { url: `http://${host}:${port}/`, method: 'POST', body: { q: 'x' } },
      }),
    });
    const text = await response.text();
    assert.equal(response.status, 400, `${host}: ${text}`);
    assert.match(text, /target\.url/);
    assert.match(text, /cluster's own Kafka controller/);
  }

  // A job stored without the API (or before this check): the worker refuses it, once.
  await assertRefusedAtExecution(fx.db.pool, node.apiUrl, {
    name: 'kraft-stored',
    url: `http://127.0.0.1:${port}/`,
    what: 'Kafka controller',
  });
});
