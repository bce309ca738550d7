import assert from 'node:assert/strict';
import { test } from 'node:test';
import Fastify from 'fastify';
import { registerHealthRoutes, type Dependency } from '../../src/api/health.js';

// Pure logic of /readyz: which failures fail readiness and what the body names. The probes are
// stand-ins here; node-boot tests check the real ones against stopped servers.

class ConnectionRefused extends Error {
  override name = 'ConnectionRefused';
}
const up: Dependency['check'] = () => undefined;
const down: Dependency['check'] = () =>
  Promise.reject(new ConnectionRefused('connect ECONNREFUSED 10.0.0.1:5432'));

async function readyz(probes: Parameters<typeof registerHealthRoutes>[1]) {
  const app = Fastify();
  registerHealthRoutes(app, probes);
  const response = await app.inject({ method: 'GET', url: '/readyz' });
  await app.close();
  return { code: response.statusCode, body: response.json() as Record<string, unknown>, text: response.body };
}

test('only a required dependency fails readiness; optional ones are named as degraded', async () => {
  const all = (postgres: typeof up, etcd: typeof up, kafka: typeof up) => ({
    postgres: { check: postgres, required: true },
    etcd: { check: etcd, required: false },
    kafka: { check: kafka, required: false },
  });
  const ready = await readyz(all(up, up, up));
  assert.equal(ready.code, 200);
  assert.deepEqual([ready.body.status, ready.body.failing, ready.body.degraded], ['ready', [], []]);

  const kafkaDown = await readyz(all(up, up, down));
  assert.equal(kafkaDown.code, 200);
  assert.deepEqual(
    [kafkaDown.body.status, kafkaDown.body.failing, kafkaDown.body.degraded],
    ['degraded', ['kafka'], ['kafka']],
  );

  const pgDown = await readyz(all(down, down, up));
  assert.equal(pgDown.code, 503);
  assert.deepEqual(
    [pgDown.body.status, pgDown.body.failing, pgDown.body.degraded],
    ['unavailable', ['postgres', 'etcd'], ['etcd']],
  );
  assert.deepEqual((pgDown.body.checks as Record<string, unknown>).postgres, {
    ok: false,
    required: true,
    error: 'ConnectionRefused',
  });
  assert.doesNotMatch(pgDown.text, /10\.0\.0\.1/, 'no addresses in the body');
});

test('a bare probe is required, and a probe that throws synchronously counts as failing', async () => {
  const result = await readyz({
    legacy: () => {
      throw new ConnectionRefused('sync');
    },
  });
  assert.equal(result.code, 503);
  assert.deepEqual(result.body.failing, ['legacy']);
});
