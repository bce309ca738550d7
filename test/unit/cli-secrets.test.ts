import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { runCli } from '../../src/cli/index.js';

// The CLI's error messages never print a secret it was given (found by a review, helper-56).

function capture() {
  const lines: string[] = [];
  return { lines, io: { out: (t: string) => lines.push(t), err: (t: string) => lines.push(t) } };
}

test('a job file that is not JSON is reported by line and column, not by quoting the text around the mistake', async (t) => {
  const dir = await mkdtemp(join(tmpdir(), 'helios-cli-secrets-'));
  t.after(() => rm(dir, { recursive: true, force: true }));
  const secret = 'sk_live_9f8e7d6c';
  // A template filled by envsubst whose placeholder lacked quotes: `"x-api-key": ${API_KEY}`.
  const unquoted = join(dir, 'unquoted.json');
  await writeFile(
    unquoted,
    `{"name":"hook","schedule":"* * * * *","target":{"url":"https://api.example.com/","headers":{"x-api-key": ${secret}}}}`,
  );
  // A missing comma after a secret value, on line 3.
  const comma = join(dir, 'comma.json');
  await writeFile(
    comma,
    `{\n  "name": "hook",\n  "target": {"headers": {"x-api-key": "${secret}" "b": 1}}\n}`,
  );
  for (const file of [unquoted, comma]) {
    const { lines, io } = capture();
    // Never reaches the API: the file is read first.
    const code = await runCli('jobs', ['apply', '-f', file], io, { HELIOS_API_URL: 'http://127.0.0.1:9' });
    assert.equal(code, 1);
    const printed = lines.join('\n');
    assert.match(printed, /not valid JSON/);
    assert.ok(!printed.includes(secret.slice(0, 6)), `printed: ${printed}`);
  }
  const { lines, io } = capture();
  await runCli('jobs', ['apply', '-f', comma], io, { HELIOS_API_URL: 'http://127.0.0.1:9' });
  assert.match(lines.join('\n'), /line 3, column \d+/);
});

test('HELIOS_API_URL with credentials is refused without printing them', async () => {
  const { lines, io } = capture();
  const code = await runCli('jobs', ['list'], io, {
    HELIOS_API_URL: 'https://ops:proxy-pass-7c1d@helios.example.com',
  });
  assert.notEqual(code, 0);
  const printed = lines.join('\n');
  assert.match(printed, /HELIOS_API_URL: must not carry credentials/);
  assert.ok(!printed.includes('proxy-pass-7c1d'), `printed: ${printed}`);
});
