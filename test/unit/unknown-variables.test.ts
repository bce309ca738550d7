import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import { settingNames, TOOL_VARIABLES, unknownVariables } from '../../src/config/unknown-variables.js';
import { REPO_ROOT } from '../support/env.js';

const required = {
  HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1:1/db',
  HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379',
  HELIOS_KAFKA_BROKERS: '127.0.0.1:9092',
};

test('a misspelt setting is reported with the setting it is nearest to; settings, tools and other variables are not', () => {
  assert.deepEqual(
    unknownVariables({
      ...required,
      HELIOS_WORKER_CONCURENCY: '8',
      HELIOS_LEASE_TTL: '3000',
      HELIOS_SOMETHING_ELSE_ENTIRELY: 'x',
      HELIOS_WORKER_CONCURRENCY: '8',
      HELIOS_API_TOKEN: 't',
      HELIOS_PG_PORT: '15432',
      PGHOST: 'db',
      PATH: '/usr/bin',
    }),
    [
      { name: 'HELIOS_LEASE_TTL', nearest: 'HELIOS_LEASE_TTL_MS' },
      { name: 'HELIOS_SOMETHING_ELSE_ENTIRELY' },
      { name: 'HELIOS_WORKER_CONCURENCY', nearest: 'HELIOS_WORKER_CONCURRENCY' },
    ],
  );
});

/** Names that look like variables and are not: an error code, a placeholder, deliberate misspellings. */
const NOT_VARIABLES = new Set([
  'HELIOS_TARGET_DENIED',
  'HELIOS_X',
  'HELIOS_WORKER_CONCURENCY',
  'HELIOS_LEASE_TTL',
  'HELIOS_SOMETHING_ELSE_ENTIRELY',
  'HELIOS_NOT_A_SETTING',
  'HELIOS_SHUTDOWN_TIMOUT_MS',
]);

function* files(dir: string): Generator<string> {
  for (const entry of readdirSync(dir)) {
    if (entry === 'node_modules' || entry === 'dist' || entry.startsWith('.helios')) continue;
    const path = join(dir, entry);
    if (statSync(path).isDirectory()) yield* files(path);
    else yield path;
  }
}

test("every HELIOS_ name the project's code, scripts and deployment files use is a setting or a tool's variable", () => {
  // A script or test that sets a new HELIOS_ variable beside a node would otherwise make every node
  // started from that shell warn of it.
  const known = new Set([...settingNames(), ...TOOL_VARIABLES, ...NOT_VARIABLES]);
  const strays = new Set<string>();
  for (const dir of ['src', 'scripts', 'bench', 'deploy', 'test', '.ci']) {
    for (const file of files(join(REPO_ROOT, dir))) {
      for (const [name] of readFileSync(file, 'utf8').matchAll(/HELIOS_[A-Z0-9_]*[A-Z0-9]/g)) {
        if (!known.has(name)) strays.add(`${name} (${file.slice(REPO_ROOT.length)})`);
      }
    }
  }
  assert.deepEqual([...strays], []);
});

test('helios migrate warns of a misspelt setting before it connects', () => {
  const result = spawnSync(process.execPath, ['--import', 'tsx', join(REPO_ROOT, 'src/main.ts'), 'migrate'], {
    cwd: REPO_ROOT,
    encoding: 'utf8',
    env: { PATH: process.env.PATH, ...required, HELIOS_WORKER_CONCURENCY: '8', HELIOS_LOG_LEVEL: 'warn' },
    timeout: 60_000,
  });
  assert.notEqual(result.status, 0, 'migrate against a closed port failed');
  assert.match(
    result.stdout + result.stderr,
    /ignoring HELIOS_WORKER_CONCURENCY \(did you mean HELIOS_WORKER_CONCURRENCY\?\)/,
  );
});
