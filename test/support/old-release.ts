import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync, symlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { REPO_ROOT } from './env.js';
import { ManagedProcess, nodeEnvironment, type NodeEnv } from './processes.js';

// An earlier release of Helios, built from this checkout's git history, for the mixed-version
// tests: the nodes of a rolling upgrade run the previous release and this checkout side by side
// against one database migrated by this checkout (docs/operations.md, "Upgrade: a rolling
// restart").

/** A built checkout of an earlier release. */
export interface OldRelease {
  /** The commit, or how it was given. */
  readonly commit: string;
  /** Its root: dist/main.js is its CLI, dist/store/… its modules. */
  readonly dir: string;
  /** Deletes the checkout if this module made it. */
  remove(): void;
}

const git = (...args: string[]) =>
  spawnSync('git', args, { cwd: REPO_ROOT, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });

/**
 * The release the newest migration was written for: the commit before the one that added it (its
 * nodes are the old nodes that meet that migration's schema). Null when the history lacks it (a
 * shallow clone).
 */
export function previousRelease(): string | null {
  const added = git('log', '-1', '--format=%H', '--diff-filter=A', '--', 'src/store/migrations/');
  const commit = added.stdout.trim();
  if (added.status !== 0 || !commit) return null;
  const parent = git('rev-parse', '--verify', '--quiet', `${commit}~1`);
  return parent.status === 0 ? parent.stdout.trim() : null;
}

/**
 * The old release to test against: HELIOS_MIXED_OLD_DIR (a checkout already built), else commit
 * HELIOS_MIXED_OLD or the previous release, exported with `git archive` and built with its own
 * tsconfig and this checkout's node_modules (its package.json may ask for other versions: then the
 * build fails and says so). A string says why there is none (the test skips).
 */
export function oldRelease(): OldRelease | string {
  const given = process.env.HELIOS_MIXED_OLD_DIR;
  if (given) {
    if (!existsSync(join(given, 'dist/main.js'))) return `${given}/dist/main.js does not exist`;
    return { commit: `${given} (HELIOS_MIXED_OLD_DIR)`, dir: given, remove: () => undefined };
  }
  const commit = process.env.HELIOS_MIXED_OLD ?? previousRelease();
  if (!commit) return 'the git history does not hold the previous release (a shallow clone?)';
  const parent = mkdtempSync(join(tmpdir(), 'helios-old-'));
  const dir = join(parent, 'checkout');
  const remove = () => rmSync(parent, { recursive: true, force: true });
  mkdirSync(dir);
  const exported = spawnSync(
    'bash',
    ['-c', `git archive --format=tar "$1" | tar -x -C "$2"`, '-', commit, dir],
    {
      cwd: REPO_ROOT,
      encoding: 'utf8',
    },
  );
  if (exported.status !== 0) {
    remove();
    return `git archive ${commit} failed: ${exported.stderr}`;
  }
  const differs = git('diff', '--quiet', commit, 'HEAD', '--', 'package.json', 'package-lock.json');
  symlinkSync(join(REPO_ROOT, 'node_modules'), join(dir, 'node_modules'));
  for (const step of [
    [join(REPO_ROOT, 'node_modules/typescript/bin/tsc'), '-p', 'tsconfig.build.json'],
    ['scripts/copy-sql.mjs'],
  ]) {
    const built = spawnSync(process.execPath, step, { cwd: dir, encoding: 'utf8' });
    if (built.status !== 0) {
      remove();
      throw new Error(
        `building ${commit} with this checkout's node_modules failed` +
          (differs.status === 0 ? '' : ' (its package.json or package-lock.json differs from HEAD’s)') +
          `: ${built.stdout}${built.stderr}`,
      );
    }
  }
  return { commit, dir, remove };
}

/** Starts `dist/main.js node` of the checkout at `root` (REPO_ROOT: this checkout). */
export function spawnNodeOf(root: string, name: string, env: NodeEnv): ManagedProcess {
  const child = spawn(process.execPath, [join(root, 'dist/main.js'), 'node'], {
    env: nodeEnvironment(name, env),
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  return new ManagedProcess(name, child);
}
