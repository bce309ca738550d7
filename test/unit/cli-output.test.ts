import assert from 'node:assert/strict';
import { test } from 'node:test';
import { details, json, table, terminalSafe } from '../../src/cli/output.js';

// eslint-disable-next-line no-control-regex -- what must not reach a terminal
const UNSAFE = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u202e\u2066]/;

test('escape sequences and control characters are printed inert and visible', () => {
  const hostile = 'ok\u001b]0;pwned\u0007\u001b[2J\rfake\u009b31m\u007f\u202eevil';
  const safe = terminalSafe(table(['error'], [[hostile]]));
  assert.doesNotMatch(safe, UNSAFE);
  assert.match(safe, /\\u001b\]0;pwned\\u0007/);
  assert.match(terminalSafe(details([['error', hostile]])), /\\u009b31m/);
  // Tabs and newlines stay: tables and multi-line messages still read.
  assert.equal(terminalSafe('a\tb\nc'), 'a\tb\nc');
});

test('--json output stays valid JSON of the same value after it is made terminal-safe', () => {
  const value = { excerpt: 'x\u001b[31mred\u009b\u007f\u2066', plain: 'é€' };
  const printed = terminalSafe(json(value));
  assert.doesNotMatch(printed, UNSAFE);
  assert.deepEqual(JSON.parse(printed), value);
});
