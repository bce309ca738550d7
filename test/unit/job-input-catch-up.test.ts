import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  compileJob,
  inputOf,
  MAX_CATCH_UP_BYTES,
  maxCatchUpFor,
  type JobRules,
} from '../../src/api/job-input.js';
import { ProblemError } from '../../src/api/problems.js';
import { RUN_ROW_BYTES } from '../../src/store/dispatch.js';
import type { JobRecord } from '../../src/store/jobs.js';
import { compileTargetPolicy } from '../../src/security/target-policy.js';

const rules: JobRules = {
  targetPolicy: compileTargetPolicy({ deny: [] }),
  sensitiveHeaders: new Set(['authorization']),
};

const job = (misfire: 'fire-all' | 'fire-once' | 'skip', maxCatchUp: number, bodyBytes: number) => ({
  name: 'catch-up-check',
  schedule: '* * * * * *',
  misfire,
  maxCatchUp,
  target: { url: 'http://192.0.2.10/hook', body: { pad: 'p'.repeat(bodyBytes) } },
});

function fieldsRefused(input: Parameters<typeof compileJob>[0]): string[] {
  try {
    compileJob(input, rules);
    return [];
  } catch (err) {
    assert.ok(err instanceof ProblemError, String(err));
    assert.equal(err.status, 400);
    return err.errors?.map((e) => `${e.field}: ${e.message}`) ?? [];
  }
}

test('fire-all may catch up only as many runs as fit the catch-up bytes, each with its copy of the target', () => {
  const bodyBytes = 60 * 1024;
  // Measured as stored: method filled in, URL normalised.
  const target = compileJob(job('fire-once', 1, bodyBytes), rules).fields.target;
  const targetBytes = Buffer.byteLength(JSON.stringify(target));
  const fits = maxCatchUpFor(targetBytes);
  assert.ok(fits * (targetBytes + RUN_ROW_BYTES) <= MAX_CATCH_UP_BYTES);
  assert.ok((fits + 1) * (targetBytes + RUN_ROW_BYTES) > MAX_CATCH_UP_BYTES);
  assert.ok(fits > 100 && fits < 10_000, `${fits} with a ${targetBytes}-byte target`);

  assert.deepEqual(fieldsRefused(job('fire-all', fits, bodyBytes)), []);
  const refused = fieldsRefused(job('fire-all', fits + 1, bodyBytes));
  assert.equal(refused.length, 1);
  assert.match(
    refused[0]!,
    new RegExp(`^maxCatchUp: with fire-all and a target of 61 KiB, at most ${fits} `),
  );
  assert.deepEqual(fieldsRefused(job('fire-all', 10_000, bodyBytes)).length, 1);
});

test('the bound leaves small targets their whole range, and other misfire policies alone', () => {
  // A target of about 1 KiB may catch up the schema's maximum, 10,000.
  assert.deepEqual(fieldsRefused(job('fire-all', 10_000, 1024)), []);
  // fire-once and skip create at most one run, whatever maxCatchUp says.
  assert.deepEqual(fieldsRefused(job('fire-once', 10_000, 60 * 1024)), []);
  assert.deepEqual(fieldsRefused(job('skip', 10_000, 60 * 1024)), []);
});

/** A job as stored after compileJob accepted `input` (what a PATCH starts from). */
function stored(input: ReturnType<typeof job>, fields = compileJob(input, rules).fields): JobRecord {
  return {
    ...fields,
    id: '00000000-0000-4000-8000-000000000001',
    nextRunAt: null,
    scheduleError: null,
    createdAt: new Date(),
    updatedAt: new Date(),
    cursorTs: '2026-01-01 00:00:00+00',
  } as JobRecord;
}

function patchRefused(record: JobRecord, patch: Record<string, unknown>): string[] {
  try {
    compileJob({ ...inputOf(record), ...patch } as never, rules, record);
    return [];
  } catch (err) {
    assert.ok(err instanceof ProblemError, String(err));
    return err.errors?.map((e) => e.field) ?? [];
  }
}

test('a create and its later edits measure the same target: the largest job a create accepts stays editable', () => {
  // The URL is percent-encoded and the method filled in when stored: both make the stored target
  // longer than the one sent. Measured as sent, the create accepted a job its next edit refused.
  for (const url of ['http://192.0.2.10/hook', 'http://192.0.2.10/hööööök']) {
    let pad = 2000;
    const accepted = (n: number) =>
      fieldsRefused({ ...job('fire-all', 10_000, n), target: { url, body: { pad: 'p'.repeat(n) } } })
        .length === 0;
    while (accepted(pad + 1)) pad++;
    assert.ok(pad > 2000 && pad < 3500, `${pad}`);
    const record = stored({
      ...job('fire-all', 10_000, pad),
      target: { url, body: { pad: 'p'.repeat(pad) } },
    });
    assert.deepEqual(patchRefused(record, { enabled: false }), [], url);
    assert.deepEqual(patchRefused(record, { name: 'renamed' }), [], url);
    // One byte more of target is past the bound, on an edit as on a create.
    assert.deepEqual(patchRefused(record, { target: { url, body: { pad: 'p'.repeat(pad + 1) } } }), [
      'maxCatchUp',
    ]);
  }
});

test('a job stored before the bound keeps its catch-up on edits that leave target, misfire and maxCatchUp alone', () => {
  const input = job('fire-all', 10_000, 60 * 1024);
  // As a job created before the bound was stored: compiled as fire-once, stored as fire-all.
  const record = stored(input, {
    ...compileJob({ ...input, misfire: 'fire-once' }, rules).fields,
    misfire: 'fire-all',
  });
  assert.deepEqual(patchRefused(record, { enabled: false }), []);
  assert.deepEqual(patchRefused(record, { schedule: '*/5 * * * * *' }), []);
  assert.deepEqual(patchRefused(record, { maxCatchUp: 9_999 }), ['maxCatchUp']);
  assert.deepEqual(patchRefused(record, { maxCatchUp: 100 }), []);
  assert.deepEqual(patchRefused(record, { misfire: 'skip' }), []);
});
