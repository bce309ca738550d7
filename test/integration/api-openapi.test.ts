import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import SwaggerParser from '@apidevtools/swagger-parser';
import { Ajv2020 } from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';
import type { OpenAPIV3_1 } from 'openapi-types';
import { inTransaction } from '../../src/store/db.js';
import { buryRun } from '../../src/store/dead-letters.js';
import { jobBody, startTestApi, type TestApi } from '../support/api.js';

let api: TestApi;
let doc: OpenAPIV3_1.Document;
before(async () => {
  api = await startTestApi();
  doc = (await api.call('GET', '/openapi.json')).body as OpenAPIV3_1.Document;
});
after(() => api.close());

test('the OpenAPI document is a valid OpenAPI 3.1 document covering every v1 route', async () => {
  assert.equal(doc.openapi, '3.1.0');
  await SwaggerParser.validate(structuredClone(doc) as never);
  const operations = Object.entries(doc.paths ?? {}).flatMap(([path, item]) =>
    Object.keys(item ?? {}).map((method) => `${method.toUpperCase()} ${path}`),
  );
  assert.deepEqual(operations.sort(), [
    'DELETE /api/v1/jobs/{id}',
    'GET /api/v1/cluster',
    'GET /api/v1/dead-letters',
    'GET /api/v1/jobs',
    'GET /api/v1/jobs/{id}',
    'GET /api/v1/jobs/{id}/runs',
    'GET /api/v1/runs/{id}',
    'PATCH /api/v1/jobs/{id}',
    'POST /api/v1/dead-letters/{id}/replay',
    'POST /api/v1/jobs',
    'POST /api/v1/jobs/{id}/pause',
    'POST /api/v1/jobs/{id}/resume',
    'POST /api/v1/jobs/{id}/trigger',
  ]);
});

test('every real response matches the schema its route declares for that status', async () => {
  const ajv = new Ajv2020({ strict: false, allErrors: true });
  addFormats.default(ajv);
  const exercised = new Set<string>();

  /** Calls a route and checks the response against the document, by template path and status. */
  async function hit(method: string, template: string, params: Record<string, string> = {}, body?: unknown) {
    const path = template.replace(/\{(\w+)\}/g, (_, name: string) => encodeURIComponent(params[name] ?? ''));
    const query = params.query ? `?${params.query}` : '';
    const response = await api.call(method, `/api/v1${path}${query}`, { body });
    const operation = (doc.paths?.[`/api/v1${template}`] as Record<string, OpenAPIV3_1.OperationObject>)?.[
      method.toLowerCase()
    ];
    assert.ok(operation, `${method} ${template} is documented`);
    const declared = operation.responses?.[String(response.status)] as OpenAPIV3_1.ResponseObject | undefined;
    assert.ok(declared, `${method} ${template} answered ${response.status}, which it does not declare`);
    exercised.add(`${method} /api/v1${template}`);
    if (response.status === 204) {
      assert.equal(response.text, '');
      return response;
    }
    const type = (response.headers.get('content-type') ?? '').split(';')[0]!;
    const schema = declared.content?.[type]?.schema;
    assert.ok(schema, `${method} ${template} ${response.status}: no schema declared for ${type}`);
    const validate = ajv.compile(schema as object);
    assert.ok(
      validate(response.body),
      `${method} ${template} ${response.status}: ${ajv.errorsText(validate.errors)} in ${response.text.slice(0, 300)}`,
    );
    return response;
  }

  const created = await hit(
    'POST',
    '/jobs',
    {},
    jobBody('schema-job', {
      target: { url: 'http://127.0.0.1:9/', headers: { 'x-api-key': 'k' }, body: { n: [1, null, 'x'] } },
    }),
  );
  const id = (created.body as { id: string }).id;
  await hit('POST', '/jobs', {}, jobBody('schema-job'));
  await hit('POST', '/jobs', {}, { name: 'x' });
  await hit('GET', '/jobs', { query: 'limit=1' });
  await hit('GET', '/jobs', { query: 'limit=-1' });
  await hit('GET', '/jobs/{id}', { id });
  await hit('GET', '/jobs/{id}', { id: 'missing' });
  await hit('PATCH', '/jobs/{id}', { id }, { timeoutMs: 2000 });
  await hit('PATCH', '/jobs/{id}', { id }, { timeoutMs: 'x' });
  await hit('PATCH', '/jobs/{id}', { id: 'missing' }, { timeoutMs: 2000 });
  const triggered = await hit('POST', '/jobs/{id}/trigger', { id });
  await hit('POST', '/jobs/{id}/trigger', { id: 'missing' });
  await hit('POST', '/jobs/{id}/pause', { id });
  await hit('POST', '/jobs/{id}/pause', { id: 'missing' });
  await hit('POST', '/jobs/{id}/resume', { id });
  await hit('POST', '/jobs/{id}/resume', { id: 'missing' });
  await hit('GET', '/jobs/{id}/runs', { id });
  await hit('GET', '/jobs/{id}/runs', { id, query: 'state=nope' });
  await hit('GET', '/jobs/{id}/runs', { id: 'missing' });
  const runId = (triggered.body as { runId: string }).runId;
  await api.db.pool.query(
    `INSERT INTO run_attempts (run_id, attempt, node_id, finished_at, outcome, status_code, duration_ms, error, response_excerpt)
     VALUES ($1, 1, 'n1', now(), 'failed', 500, 3, 'HTTP 500', 'oops')`,
    [runId],
  );
  await hit('GET', '/runs/{id}', { id: runId });
  await hit('GET', '/runs/{id}', { id: '00000000-0000-4000-8000-000000000000' });

  const letterId = await inTransaction(api.db.pool, async (client) => {
    await client.query(`UPDATE runs SET state = 'dead', attempt = 3, finished_at = now() WHERE id = $1`, [
      runId,
    ]);
    return buryRun(
      client,
      { id: runId, jobId: id, attempt: 3, scheduledFor: new Date() },
      { error: 'HTTP 500', statusCode: 500 },
      { deadLetterTopic: 'schema.dlq' },
    );
  });
  await hit('GET', '/dead-letters');
  await hit('GET', '/dead-letters', { query: 'cursor=bad' });
  await hit('POST', '/dead-letters/{id}/replay', { id: letterId });
  await hit('POST', '/dead-letters/{id}/replay', { id: letterId });
  await hit('POST', '/dead-letters/{id}/replay', { id: '00000000-0000-4000-8000-000000000000' });
  await hit('GET', '/cluster');
  await hit('DELETE', '/jobs/{id}', { id });
  await hit('DELETE', '/jobs/{id}', { id });

  const documented = Object.entries(doc.paths ?? {}).flatMap(([path, item]) =>
    Object.keys(item ?? {}).map((method) => `${method.toUpperCase()} ${path}`),
  );
  assert.deepEqual([...exercised].sort(), documented.sort(), 'every documented route was exercised');
});

test('the writes that may answer 409 concurrent-change declare it (docs/api.md, Errors)', () => {
  // A pause, edit or delete that kept finding the job's runs held, or any write PostgreSQL rolled
  // back for meeting another (toProblem); replay and trigger have their own 409 too.
  for (const [method, path] of [
    ['post', '/api/v1/jobs'],
    ['patch', '/api/v1/jobs/{id}'],
    ['delete', '/api/v1/jobs/{id}'],
    ['post', '/api/v1/jobs/{id}/pause'],
    ['post', '/api/v1/jobs/{id}/trigger'],
    ['post', '/api/v1/dead-letters/{id}/replay'],
  ] as const) {
    const operation = (doc.paths?.[path] as Record<string, OpenAPIV3_1.OperationObject>)[method]!;
    const conflict = operation.responses?.['409'] as OpenAPIV3_1.ResponseObject | undefined;
    assert.ok(
      conflict?.content?.['application/problem+json'],
      `${method.toUpperCase()} ${path} declares 409`,
    );
  }
});

test('/docs serves Swagger UI from local assets, with no call-outs', async () => {
  const page = await fetch(`${api.url}/docs`);
  assert.equal(page.status, 200);
  const html = await page.text();
  assert.match(html, /swagger-ui/i);
  assert.doesNotMatch(html, /(src|href)="https?:\/\//);
  const bundle = await fetch(`${api.url}/docs/static/swagger-ui-bundle.js`);
  assert.equal(bundle.status, 200);
  assert.match(bundle.headers.get('content-type') ?? '', /javascript/);
  assert.ok((await bundle.arrayBuffer()).byteLength > 100_000);
  const initializer = await (await fetch(`${api.url}/docs/static/swagger-initializer.js`)).text();
  assert.doesNotMatch(initializer, /validator\.swagger\.io/);
});
