import assert from 'node:assert/strict';
import { test } from 'node:test';

import { compileJob, type JobRules } from '../../src/api/job-input.js';
import { ProblemError } from '../../src/api/problems.js';
import { compileTargetPolicy } from '../../src/security/target-policy.js';

const rules: JobRules = {
  targetPolicy: compileTargetPolicy({ deny: [] }),
  sensitiveHeaders: new Set(['authorization']),
};
const job = (schedule: string, timezone?: string) => ({
  name: 'schedule-check',
  schedule,
  ...(timezone === undefined ? {} : { timezone }),
  target: { url: 'http://192.0.2.10/hook' },
});

/** The 400 problem compileJob throws, with its field errors. */
function problemOf(schedule: string, timezone?: string): ProblemError {
  try {
    compileJob(job(schedule, timezone), rules);
  } catch (err) {
    assert.ok(err instanceof ProblemError, `expected a ProblemError for "${schedule}", got ${String(err)}`);
    return err;
  }
  assert.fail(`"${schedule}" was accepted`);
}

test('a schedule that never fires is a 400 naming schedule, not a crash', () => {
  // The last two overflowed croner 9's stack: a RangeError the API turned into a 500.
  for (const schedule of ['0 0 31 2 *', '0 0 31 4 *', '0 0 31 4,6,9,11 *', '0 0 31 2,4,6,9,11 *']) {
    for (const timezone of [undefined, 'America/New_York']) {
      const problem = problemOf(schedule, timezone);
      assert.equal(problem.status, 400);
      assert.deepEqual(
        problem.errors?.map((e) => e.field),
        ['schedule'],
      );
      assert.match(problem.errors?.[0]?.message ?? '', /never fires/);
    }
  }
});

test('a schedule that fires, however rarely, compiles', () => {
  const { fields, schedule } = compileJob(job('0 0 29 2 *', 'Europe/Berlin'), rules);
  assert.equal(fields.schedule, '0 0 29 2 *');
  assert.equal(schedule.next(new Date('2026-12-01T00:00:00Z'))?.toISOString(), '2028-02-28T23:00:00.000Z');
});
