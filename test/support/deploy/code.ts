import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { loadConfig } from '../../../src/config/index.js';
import { settingNames } from '../../../src/config/unknown-variables.js';
import { REPO_ROOT } from '../env.js';

// Checks of the deployment files (deploy/compose.yaml, deploy/kubernetes/, Dockerfile) against the
// code they deploy: the variables src/config/ reads, the CLI's commands, the health routes. Each
// check returns the problems it found, so a test can show it reports a broken file.

export type Env = Record<string, string>;

/** Every variable the node's and the CLI's config read (src/config/unknown-variables.ts). */
export const acceptedVariables = settingNames;

/** The commands of the `helios` CLI, from its own usage text (`helios --help`). */
export function cliCommands(): Set<string> {
  const result = spawnSync(process.execPath, ['--import', 'tsx', join(REPO_ROOT, 'src/main.ts'), '--help'], {
    encoding: 'utf8',
    cwd: REPO_ROOT,
  });
  if (result.status !== 0) throw new Error(`helios --help failed: ${result.stderr}`);
  const commands = new Set<string>();
  for (const line of result.stdout.split('\n')) {
    const match = /^ {2}([a-z][a-z-]*)\b/.exec(line);
    if (match) commands.add(match[1]!);
  }
  return commands;
}

/** The routes the node serves outside /api/v1 that probes may use. */
export function healthRoutes(): Set<string> {
  const source = readFileSync(join(REPO_ROOT, 'src/api/health.ts'), 'utf8');
  return new Set([...source.matchAll(/app\.get\('([^']+)'/g)].map((m) => m[1]!));
}

/** A real tool if one is installed on the PATH. */
export function findTool(
  names: string[],
  args: string[] = [],
  probeArgs = [...args, 'version'],
): string[] | null {
  for (const name of names) {
    const probe = spawnSync(name, probeArgs, { encoding: 'utf8' });
    if (probe.status === 0) return [name, ...args];
  }
  return null;
}

/** A node's environment must pass src/config/; returns the problem or null. */
export function configProblem(env: Env): { problem: string | null; shutdownMs: number } {
  try {
    return { problem: null, shutdownMs: loadConfig(env).node.shutdownTimeoutMs };
  } catch (err) {
    return { problem: (err as Error).message, shutdownMs: NaN };
  }
}
