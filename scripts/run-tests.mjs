// Runs node's test runner over test/**/*.test.ts.
// Usage: node scripts/run-tests.mjs [folder | file | glob ...]   e.g. test/unit
//
// Test files run in two groups. Those marked `// test-runner: alone` at the start of a line (they
// stop and start the shared PostgreSQL, etcd or Kafka, or measure time under a load of their own)
// run one at a time, first. The others run HELIOS_TEST_CONCURRENCY at a time (default 2): each has
// its own database, topics and etcd prefix, and most of their time is spent waiting for leases,
// thresholds and back-offs, not on the CPU.
import { spawnSync } from 'node:child_process';
import { existsSync, globSync, readFileSync, statSync } from 'node:fs';

// `npm test` runs this with the Node.js of the pinned `node` devDependency (npm puts
// node_modules/.bin first on the PATH), whatever the system's is; say which one.
console.log(`# Node.js ${process.version}`);
if (Number(process.versions.node.split('.')[0]) < 24) {
  console.error('Helios needs Node.js 24: run the tests through npm (npm test), which uses the pinned one');
  process.exit(1);
}
// A folder stands for the test files under it.
const args = process.argv.slice(2);
const patterns = (args.length ? args : ['test']).map((arg) =>
  existsSync(arg) && statSync(arg).isDirectory() ? `${arg.replace(/\/$/, '')}/**/*.test.ts` : arg,
);
const files = [...new Set(patterns.flatMap((p) => (existsSync(p) ? [p] : globSync(p))))].sort();
if (files.length === 0) {
  console.error(`no test file matches ${patterns.join(' ')}`);
  process.exit(1);
}
const ALONE = /^\/\/ test-runner: alone\b/m;
const alone = files.filter((file) => ALONE.test(readFileSync(file, 'utf8')));
const together = files.filter((file) => !alone.includes(file));
const concurrency = Number(process.env.HELIOS_TEST_CONCURRENCY ?? 2);
if (!Number.isInteger(concurrency) || concurrency < 1) {
  console.error(
    `HELIOS_TEST_CONCURRENCY must be a whole number ≥ 1, not ${process.env.HELIOS_TEST_CONCURRENCY}`,
  );
  process.exit(1);
}

// The tests need the real servers: start them (idempotent: nothing to do when they are up).
const infra = spawnSync('bash', ['scripts/infra.sh', 'up'], { stdio: 'inherit' });
if (infra.status !== 0) {
  console.error('scripts/infra.sh up failed: the tests need PostgreSQL, etcd and Kafka');
  process.exit(1);
}

/** Runs `group` through node --test, `filesAtOnce` files at a time; true when every test passed. */
function runGroup(name, group, filesAtOnce) {
  if (group.length === 0) return true;
  console.log(`# ${name}: ${group.length} file(s), ${filesAtOnce} at a time`);
  const result = spawnSync(
    process.execPath,
    // tsx, not Node's own type stripping: our sources import './x.js', which stripping does not map
    // to x.ts.
    ['--test', `--test-concurrency=${filesAtOnce}`, '--test-timeout=300000', '--import', 'tsx', ...group],
    { stdio: 'inherit' },
  );
  return result.status === 0;
}

const started = Date.now();
// Both groups run even when the first fails, so one run shows every failure.
const aloneOk = runGroup('files that run alone', alone, 1);
const togetherOk = runGroup('the other files', together, concurrency);
console.log(`# ${files.length} test files in ${Math.round((Date.now() - started) / 1000)} s`);
process.exit(aloneOk && togetherOk ? 0 : 1);
