import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const HERE = fileURLToPath(new URL('.', import.meta.url));

/**
 * Installs the peers (bench/peers/package.json, its own node_modules, pinned by its lockfile)
 * when they are missing. Output goes to stderr so the benchmark's stdout stays a table.
 */
export async function ensurePeersInstalled(): Promise<void> {
  const installed = ['pg-boss', 'graphile-worker'].every((name) =>
    existsSync(`${HERE}node_modules/${name}/package.json`),
  );
  if (installed) return;
  const command = existsSync(`${HERE}package-lock.json`) ? 'ci' : 'install';
  console.error(`installing the peer queues: npm ${command} --prefix bench/peers`);
  const child = spawn('npm', [command, '--prefix', HERE, '--no-audit', '--no-fund'], {
    stdio: ['ignore', process.stderr, process.stderr],
  });
  const [code] = (await once(child, 'exit')) as [number | null];
  if (code !== 0) throw new Error(`npm ${command} --prefix bench/peers failed (exit ${code})`);
}
