import assert from 'node:assert/strict';
import { test } from 'node:test';
import { toProblem } from '../../src/api/problems.js';
import { JobDeleteInterruptedError } from '../../src/jobs/commands.js';

// PostgreSQL rolls a whole transaction back on these codes, so the request wrote nothing and may
// be tried again: a 409 the caller can act on, not a 500.
test('a deadlock, a serialization failure and a lock wait given up are a 409 concurrent-change', () => {
  for (const code of ['40P01', '40001', '55P03']) {
    const problem = toProblem(Object.assign(new Error('from PostgreSQL'), { code }));
    assert.equal(problem.status, 409, code);
    assert.match(problem.detail ?? '', /nothing was written, try again/, code);
  }
});

test('another PostgreSQL error is still a 500', () => {
  assert.equal(toProblem(Object.assign(new Error('x'), { code: '42P01' })).status, 500);
});

test("a job's delete stopped after some of its history went says so, never that nothing was written", () => {
  const stopped = new JobDeleteInterruptedError(20_000, {
    cause: Object.assign(new Error('from PostgreSQL'), { code: '55P03' }),
  });
  const problem = toProblem(stopped);
  assert.equal(problem.status, 409);
  assert.equal(problem.slug, 'concurrent-change');
  assert.match(problem.detail ?? '', /after 20000 finished runs of the job were deleted/);
  assert.match(problem.detail ?? '', /send the delete again/);
  assert.doesNotMatch(problem.detail ?? '', /nothing was written/);
  // Whatever stopped it keeps its own status.
  const failed = toProblem(new JobDeleteInterruptedError(1, { cause: new Error('socket hang up') }));
  assert.equal(failed.status, 500);
  assert.match(failed.detail ?? '', /after 1 finished runs/);
});

test('a database that cannot be reached or did not answer in time is a 503 with Retry-After; a bug is still a 500', () => {
  const outages = [
    Object.assign(new Error('canceling statement due to statement timeout'), { code: '57014' }),
    Object.assign(new Error('the database system is shutting down'), { code: '57P03' }),
    Object.assign(new Error('sorry, too many clients already'), { code: '53300' }),
    Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' }),
    // Five capital letters like a SQLSTATE, but no digit: a system code.
    Object.assign(new Error('write EPIPE'), { code: 'EPIPE' }),
    new Error('Connection terminated unexpectedly'),
    new Error('timeout exceeded when trying to connect'),
    new Error('Query read timeout'),
  ];
  for (const err of outages) {
    const problem = toProblem(err);
    assert.equal(problem.status, 503, err.message);
    assert.equal(problem.slug, 'database-unavailable', err.message);
    assert.equal(problem.headers['retry-after'], '2', err.message);
  }
  for (const err of [
    new TypeError("Cannot read properties of undefined (reading 'id')"),
    new Error('ENOENT'),
  ]) {
    assert.equal(toProblem(err).status, 500, err.message);
  }
  assert.equal(toProblem(Object.assign(new Error('x'), { code: 'ENOENT' })).status, 500);
});
