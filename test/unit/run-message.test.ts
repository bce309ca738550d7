import assert from 'node:assert/strict';
import { test } from 'node:test';
import { InvalidRunMessageError, parseRunMessage, parseHandOff } from '../../src/execution/run-message.js';

const runId = '7d3c2a8e-4b7f-4a51-9a0e-3f7f2b6d9c11';
const jobId = '0b8a1e43-8f1c-4a9e-b2d4-5c6e7f8a9b0c';

test('a dispatcher message parses (PostgreSQL timestamp format)', () => {
  const message = parseRunMessage(
    JSON.stringify({
      runId,
      jobId,
      attempt: 1,
      scheduledFor: '2026-01-01T00:00:05+00:00',
      notBefore: '2026-01-01T00:00:05.25+00:00',
      timeoutMs: 30000,
      concurrency: 'forbid',
    }),
  );
  assert.equal(message.runId, runId);
  assert.equal(message.timeoutMs, 30000);
  assert.equal(message.concurrency, 'forbid');
  assert.equal(message.attempt, 1);
  assert.equal(message.scheduledFor.toISOString(), '2026-01-01T00:00:05.000Z');
  assert.equal(message.notBefore.toISOString(), '2026-01-01T00:00:05.250Z');
});

test('notBefore defaults to scheduledFor', () => {
  const message = parseRunMessage(
    JSON.stringify({ runId, jobId, attempt: 2, scheduledFor: '2026-01-01T00:00:00Z' }),
  );
  assert.equal(message.notBefore.getTime(), message.scheduledFor.getTime());
  assert.equal(message.timeoutMs, undefined, 'an older message has no timeout');
});

test('unusable messages are rejected with InvalidRunMessageError', () => {
  const bad = [
    null,
    'not json',
    '42',
    JSON.stringify({ runId: 'x', jobId, attempt: 1, scheduledFor: '2026-01-01T00:00:00Z' }),
    JSON.stringify({ runId, jobId, attempt: 0, scheduledFor: '2026-01-01T00:00:00Z' }),
    JSON.stringify({ runId, jobId, attempt: 1.5, scheduledFor: '2026-01-01T00:00:00Z' }),
    JSON.stringify({ runId, jobId, attempt: 1, scheduledFor: 'yesterday' }),
    JSON.stringify({ runId, jobId, attempt: 1, scheduledFor: '2026-01-01T00:00:00Z', notBefore: 5 }),
    JSON.stringify({ runId, jobId, attempt: 1, scheduledFor: '2026-01-01T00:00:00Z', timeoutMs: '5000' }),
    JSON.stringify({ runId, jobId, attempt: 1, scheduledFor: '2026-01-01T00:00:00Z', timeoutMs: 0 }),
    JSON.stringify({ runId, jobId, attempt: 1, scheduledFor: '2026-01-01T00:00:00Z', concurrency: 'never' }),
  ];
  for (const value of bad) assert.throws(() => parseRunMessage(value), InvalidRunMessageError, String(value));
});

test('a hand-off payload carries run messages for one node or all; an unusable item costs only itself', () => {
  const good = { runId, jobId, attempt: 2, scheduledFor: '2026-01-01T00:00:00Z', timeoutMs: 500 };
  const runs = [good, { ...good, runId: 'x' }, 42, good];
  const messages = parseHandOff(JSON.stringify({ runs }), 'node-a');
  assert.equal(messages.length, 2);
  assert.equal(messages[0]!.attempt, 2);
  assert.equal(messages[0]!.timeoutMs, 500);
  assert.equal(parseHandOff(JSON.stringify({ to: 'node-a', runs }), 'node-a').length, 2);
  assert.deepEqual(
    parseHandOff(JSON.stringify({ to: 'node-b', runs }), 'node-a'),
    [],
    'addressed to another',
  );
  assert.throws(() => parseHandOff(JSON.stringify([good]), 'node-a'), InvalidRunMessageError);
  assert.throws(() => parseHandOff('not json', 'node-a'), InvalidRunMessageError);
});
