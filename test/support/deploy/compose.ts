import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import YAML from 'yaml';
import { configProblem, findTool, type Env } from './code.js';

// deploy/compose.yaml: resolved by a real compose implementation when one is installed.

/** `docker compose` (v2 plugin) or a standalone `docker-compose` v2, when installed. */
export function composeTool(): string[] | null {
  const standalone = findTool(['docker-compose']);
  if (standalone) {
    const version = spawnSync(standalone[0]!, ['version', '--short'], { encoding: 'utf8' }).stdout.trim();
    // v1 (Python) has no `config --format json` and does not know the names of ports.
    if (/^v?2\./.test(version) || /^v?[3-9]\./.test(version)) return standalone;
  }
  return findTool(['docker'], ['compose']);
}

export interface ComposeService {
  image?: string;
  command?: string[];
  entrypoint?: string[];
  environment?: Record<string, string | null>;
  depends_on?: Record<string, { condition?: string }>;
  healthcheck?: { test?: string[] | string };
  ports?: { name?: string; target?: number; published?: string; host_ip?: string }[];
  volumes?: ({ type?: string; source?: string; target?: string } | string)[];
  restart?: string;
  stop_grace_period?: string;
}

export interface ComposeModel {
  services: Record<string, ComposeService>;
  volumes?: Record<string, unknown>;
}

/**
 * `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?message}`, `${NAME?message}` and `$$`,
 * as compose interpolates them (used only when no compose implementation is installed).
 */
function interpolate(text: string, env: Env): string {
  return text.replace(
    /\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])([^}]*))?\}/g,
    (whole, name: string | undefined, colon: string, op: string, arg: string) => {
      if (whole === '$$') return '$';
      const value = env[name!];
      const unset = value === undefined || (colon === ':' && value === '');
      if (!unset) return value!;
      if (op === '-') return arg;
      if (op === '?') throw new Error(`compose: ${name} is required: ${arg}`);
      return '';
    },
  );
}

/** The compose file as a compose implementation resolves it; `via` says which. */
export function loadCompose(file: string, env: Env): { model: ComposeModel; via: string } {
  const tool = composeTool();
  if (tool) {
    const result = spawnSync(tool[0]!, [...tool.slice(1), '-f', file, 'config', '--format', 'json'], {
      encoding: 'utf8',
      env: { PATH: process.env.PATH ?? '', HOME: process.env.HOME ?? '/tmp', ...env },
    });
    if (result.status !== 0) throw new Error(`${tool.join(' ')} config failed: ${result.stderr}`);
    return { model: JSON.parse(result.stdout) as ComposeModel, via: `${tool.join(' ')} config` };
  }
  return { model: parseCompose(readFileSync(file, 'utf8'), env), via: 'YAML parser (no compose installed)' };
}

/** Parses compose YAML (merge keys, interpolation, short forms normalised as `config` does). */
export function parseCompose(text: string, env: Env): ComposeModel {
  const raw = YAML.parse(interpolate(text, env), { merge: true }) as ComposeModel;
  for (const service of Object.values(raw.services ?? {})) {
    if (service.environment) {
      service.environment = Object.fromEntries(
        Object.entries(service.environment).map(([k, v]) => [k, v === null ? null : String(v)]),
      );
    }
    if (Array.isArray(service.depends_on)) {
      service.depends_on = Object.fromEntries(
        (service.depends_on as string[]).map((name) => [name, { condition: 'service_started' }]),
      );
    }
    if (typeof service.command === 'string') service.command = (service.command as string).split(/\s+/);
  }
  return raw;
}

/** Seconds of a compose or Go duration such as `30s`, `1m30s`. */
function seconds(duration: string | undefined): number {
  if (!duration) return 10; // compose's default stop_grace_period
  let total = 0;
  for (const [, n, unit] of duration.matchAll(/(\d+(?:\.\d+)?)(ms|s|m|h)/g))
    total += Number(n) * { ms: 0.001, s: 1, m: 60, h: 3600 }[unit as 'ms' | 's' | 'm' | 'h'];
  return total;
}

/** Everything wrong with the Helios services of a compose model. */
export function checkCompose(
  model: ComposeModel,
  accepted: Set<string>,
  commands: Set<string>,
  /** The image's own ENV (dockerfile.ts imageEnv), under each service's environment. */
  imageEnv: Env = {},
): string[] {
  const problems: string[] = [];
  const services = model.services ?? {};
  const helios = Object.entries(services).filter(([, s]) => s.image?.startsWith('helios'));
  if (helios.filter(([, s]) => s.command?.[0] === 'node').length < 3)
    problems.push('fewer than 3 Helios nodes (`command: [node]`)');
  for (const [name, service] of Object.entries(services)) {
    for (const [dep, { condition }] of Object.entries(service.depends_on ?? {})) {
      const target = services[dep];
      if (!target) {
        problems.push(`${name}: depends on ${dep}, which is not a service`);
        continue;
      }
      if (condition === 'service_healthy' && !target.healthcheck?.test)
        problems.push(`${name}: waits for ${dep} to be healthy, which has no healthcheck`);
      if (condition === 'service_completed_successfully' && target.restart !== 'no')
        problems.push(`${name}: waits for ${dep} to complete, which restarts`);
    }
    for (const volume of service.volumes ?? []) {
      const source = typeof volume === 'string' ? volume.split(':')[0] : volume.source;
      const named =
        typeof volume === 'string'
          ? !source!.startsWith('.') && !source!.startsWith('/')
          : volume.type === 'volume';
      if (named && source && !(source in (model.volumes ?? {})))
        problems.push(`${name}: volume ${source} is not declared`);
    }
    for (const port of service.ports ?? [])
      if (!port.name) problems.push(`${name}: port ${port.target} has no name`);
  }
  for (const [name, service] of helios) {
    const command = service.command ?? [];
    if (!commands.has(command[0] ?? ''))
      problems.push(`${name}: command "${command.join(' ')}" is not a helios command`);
    const env: Env = Object.fromEntries(Object.entries(imageEnv).filter(([k]) => k.startsWith('HELIOS_')));
    for (const [key, value] of Object.entries(service.environment ?? {})) {
      if (!key.startsWith('HELIOS_')) problems.push(`${name}: ${key} is not a HELIOS_* variable`);
      else if (!accepted.has(key)) problems.push(`${name}: ${key} is not a variable src/config/ reads`);
      if (value !== null) env[key] = value;
    }
    const { problem, shutdownMs } = configProblem(env);
    if (problem) problems.push(`${name}: its environment fails src/config/: ${problem}`);
    // Every server named in the node's settings must be a service of this file.
    const hosts = [
      ...(env.HELIOS_ETCD_ENDPOINTS ?? '').split(',').map((u) => (u ? new URL(u).hostname : '')),
      ...(env.HELIOS_KAFKA_BROKERS ?? '').split(',').map((b) => b.split(':')[0] ?? ''),
      env.HELIOS_DATABASE_URL ? new URL(env.HELIOS_DATABASE_URL).hostname : '',
    ].filter(Boolean);
    for (const host of hosts) if (!services[host]) problems.push(`${name}: ${host} is not a service`);
    if (command[0] !== 'node') continue;
    for (const host of new Set(hosts))
      if (!service.depends_on?.[host]) problems.push(`${name}: does not depend on ${host}`);
    const test = [service.healthcheck?.test ?? []].flat().join(' ');
    if (!test.includes('/readyz')) problems.push(`${name}: healthcheck does not ask /readyz`);
    if (!problem && !(seconds(service.stop_grace_period) * 1000 > shutdownMs))
      problems.push(`${name}: stop_grace_period is not above HELIOS_SHUTDOWN_TIMEOUT_MS (${shutdownMs} ms)`);
  }
  return problems;
}
