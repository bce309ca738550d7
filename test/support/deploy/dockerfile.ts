import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { REPO_ROOT } from '../env.js';

/** Everything wrong with the Dockerfile and .dockerignore. */
export function checkDockerfile(dockerfile: string, dockerignore: string, commands: Set<string>): string[] {
  const problems: string[] = [];
  const pkg = JSON.parse(readFileSync(join(REPO_ROOT, 'package.json'), 'utf8')) as {
    devDependencies: Record<string, string>;
  };
  const pinned = pkg.devDependencies.node ?? '';
  const lines = dockerfile
    .replace(/\\\n/g, ' ')
    .split('\n')
    .map((l) => l.trim());
  const args = new Map(
    lines.flatMap((l) => [...l.matchAll(/^ARG (\w+)=(\S+)/g)].map((m) => [m[1]!, m[2]!] as const)),
  );
  const froms = lines
    .filter((l) => l.startsWith('FROM '))
    .map((l) => l.split(/\s+/)[1]!.replace(/\$\{(\w+)\}/, (_, name: string) => args.get(name) ?? ''));
  if (froms.length < 2) problems.push('not a multi-stage build');
  // The very Node.js the tests ran on (a floating tag moves under a rebuild), or a digest.
  for (const from of froms)
    if (!from.startsWith(`node:${pinned}-`) && !from.includes('@sha256:'))
      problems.push(`FROM ${from}: not Node.js ${pinned} (the node devDependency the tests run on)`);
  const users = lines.filter((l) => l.startsWith('USER ')).map((l) => l.slice(5).trim());
  if (users.length === 0 || ['root', '0'].includes(users.at(-1)!)) problems.push('the image runs as root');
  if (!lines.some((l) => /^RUN .*npm ci .*--omit=dev/.test(l))) problems.push('no production-only npm ci');
  const healthcheck = lines.find((l) => l.startsWith('HEALTHCHECK '));
  if (!healthcheck?.includes('/readyz')) problems.push('HEALTHCHECK does not ask /readyz');
  const entrypoint = lines.find((l) => l.startsWith('ENTRYPOINT '));
  if (!entrypoint?.includes('"helios"')) problems.push('ENTRYPOINT is not the helios CLI');
  const cmd = /^CMD \["([^"]+)"/.exec(lines.find((l) => l.startsWith('CMD ')) ?? '')?.[1];
  if (!cmd || !commands.has(cmd)) problems.push(`CMD ${cmd} is not a helios command`);
  // Every file copied from the context must exist and not be excluded by .dockerignore.
  const ignored = dockerignore
    .split('\n')
    .map((l) => l.trim())
    .filter((l) => l && !l.startsWith('#'));
  for (const line of lines.filter((l) => l.startsWith('COPY ') && !l.includes('--from='))) {
    const parts = line
      .split(/\s+/)
      .slice(1)
      .filter((p) => !p.startsWith('--'));
    for (const source of parts.slice(0, -1)) {
      if (!existsSync(join(REPO_ROOT, source))) problems.push(`COPY ${source}: no such file`);
      const top = source.split('/')[0]!;
      if (ignored.some((pattern) => pattern === source || pattern === top))
        problems.push(`COPY ${source}: excluded by .dockerignore`);
    }
  }
  return problems;
}

/** The ENV of a Dockerfile's last stage: what every container of the image starts with. */
export function imageEnv(dockerfile: string): Record<string, string> {
  const runtime =
    dockerfile
      .replace(/\\\n/g, ' ')
      .split(/^FROM /m)
      .at(-1) ?? '';
  const env: Record<string, string> = {};
  for (const line of runtime.split('\n').filter((l) => l.startsWith('ENV ')))
    for (const [, key, value] of line.slice(4).matchAll(/(\w+)=(\S+)/g)) env[key!] = value!;
  return env;
}
