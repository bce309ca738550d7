// Runs node's test runner over test/**/*.test.ts (Node 20's --test does not expand globs itself).
// Usage: node scripts/run-tests.mjs [path-prefix ...]   e.g. test/unit
import { spawnSync } from 'node:child_process';
import { readdirSync } from 'node:fs';
import { join } from 'node:path';

function find(dir) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return find(path);
    return entry.name.endsWith('.test.ts') ? [path] : [];
  });
}

// `npm test` runs this with the Node.js of the pinned `node` devDependency (npm puts
// node_modules/.bin first on the PATH), whatever the system's is; say which one.
console.log(`# Node.js ${process.version}`);
if (Number(process.versions.node.split('.')[0]) < 24) {
  console.error('Helios needs Node.js 24: run the tests through npm (npm test), which uses the pinned one');
  process.exit(1);
}
const prefixes = process.argv.slice(2);
// Unit tests first: they are fast and fail early.
const files = find('test')
  .filter((f) => prefixes.length === 0 || prefixes.some((p) => f.startsWith(p)))
  .sort(
    (a, b) => Number(b.startsWith('test/unit')) - Number(a.startsWith('test/unit')) || a.localeCompare(b),
  );
if (files.length === 0) {
  console.error('no test files found');
  process.exit(1);
}
// The tests need the real servers: start them (idempotent: nothing to do when they are up).
const infra = spawnSync('bash', ['scripts/infra.sh', 'up'], { stdio: 'inherit' });
if (infra.status !== 0) {
  console.error('scripts/infra.sh up failed: the tests need PostgreSQL, etcd and Kafka');
  process.exit(1);
}
// One file at a time: integration tests stop and start the shared real servers.
const result = spawnSync(
  process.execPath,
  ['--test', '--test-concurrency=1', '--test-timeout=300000', '--import', 'tsx', ...files],
  { stdio: 'inherit' },
);
process.exit(result.status ?? 1);
