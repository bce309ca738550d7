// Runs node's test runner over test/**/*.test.ts; Node 24's --test expands the globs itself.
// Usage: node scripts/run-tests.mjs [folder | file | glob ...]   e.g. test/unit
import { spawnSync } from 'node:child_process';
import { existsSync, statSync } from 'node:fs';

// `npm test` runs this with the Node.js of the pinned `node` devDependency (npm puts
// node_modules/.bin first on the PATH), whatever the system's is; say which one.
console.log(`# Node.js ${process.version}`);
if (Number(process.versions.node.split('.')[0]) < 24) {
  console.error('Helios needs Node.js 24: run the tests through npm (npm test), which uses the pinned one');
  process.exit(1);
}
// A folder stands for the test files under it. Node sorts what the patterns match, so the order is
// by path (test/chaos, test/integration, test/unit); `npm run test:unit` is the fast check.
const args = process.argv.slice(2);
const patterns = (args.length ? args : ['test']).map((arg) =>
  existsSync(arg) && statSync(arg).isDirectory() ? `${arg.replace(/\/$/, '')}/**/*.test.ts` : arg,
);
// The tests need the real servers: start them (idempotent: nothing to do when they are up).
const infra = spawnSync('bash', ['scripts/infra.sh', 'up'], { stdio: 'inherit' });
if (infra.status !== 0) {
  console.error('scripts/infra.sh up failed: the tests need PostgreSQL, etcd and Kafka');
  process.exit(1);
}
// One file at a time: integration tests stop and start the shared real servers.
const result = spawnSync(
  process.execPath,
  // tsx, not Node's own type stripping: our sources import './x.js', which stripping does not map
  // to x.ts.
  ['--test', '--test-concurrency=1', '--test-timeout=300000', '--import', 'tsx', ...patterns],
  { stdio: 'inherit' },
);
process.exit(result.status ?? 1);
