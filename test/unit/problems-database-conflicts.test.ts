import assert from 'node:assert/strict';
import { test } from 'node:test';
import { toProblem } from '../../src/api/problems.js';

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
