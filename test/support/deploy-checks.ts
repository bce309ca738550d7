import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import YAML from 'yaml';
import { loadCliConfig, loadConfig } from '../../src/config.js';
import { REPO_ROOT } from './env.js';

// Checks of the deployment files (deploy/compose.yaml, deploy/kubernetes/, Dockerfile) against the
// code they deploy: the variables src/config.ts reads, the CLI's commands, the health routes. Each
// check returns the problems it found, so a test can show it reports a broken file.

type Env = Record<string, string>;

/**
 * Every variable the node's and the CLI's config read, found by running them on an environment
 * that records each name looked up: the list cannot drift from src/config.ts.
 */
export function acceptedVariables(): Set<string> {
  const read = new Set<string>();
  const recording = (base: Env) =>
    new Proxy(base, {
      get(target, name) {
        if (typeof name === 'string') read.add(name);
        return target[name as string];
      },
    });
  loadConfig(
    recording({
      HELIOS_DATABASE_URL: 'postgres://u@127.0.0.1:5432/db',
      HELIOS_ETCD_ENDPOINTS: 'http://127.0.0.1:2379',
      HELIOS_KAFKA_BROKERS: '127.0.0.1:9092',
    }),
  );
  loadCliConfig(recording({}));
  return new Set([...read].filter((name) => name.startsWith('HELIOS_')));
}

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

// ------------------------------------------------------------------------------ tools

/** A real tool if one is installed on the PATH. */
function findTool(names: string[], args: string[] = [], probeArgs = [...args, 'version']): string[] | null {
  for (const name of names) {
    const probe = spawnSync(name, probeArgs, { encoding: 'utf8' });
    if (probe.status === 0) return [name, ...args];
  }
  return null;
}

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

/** `kustomize`, or the one built into kubectl, when installed. */
export function kustomizeTool(): string[] | null {
  return findTool(['kustomize']) ?? findTool(['kubectl'], ['kustomize'], ['version', '--client']);
}

// ------------------------------------------------------------------------------ compose

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

/** A node's environment must pass src/config.ts; returns the problem or null. */
function configProblem(env: Env): { problem: string | null; shutdownMs: number } {
  try {
    return { problem: null, shutdownMs: loadConfig(env).shutdownTimeoutMs };
  } catch (err) {
    return { problem: (err as Error).message, shutdownMs: NaN };
  }
}

/** Everything wrong with the Helios services of a compose model. */
export function checkCompose(model: ComposeModel, accepted: Set<string>, commands: Set<string>): string[] {
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
    const env: Env = {};
    for (const [key, value] of Object.entries(service.environment ?? {})) {
      if (!key.startsWith('HELIOS_')) problems.push(`${name}: ${key} is not a HELIOS_* variable`);
      else if (!accepted.has(key)) problems.push(`${name}: ${key} is not a variable src/config.ts reads`);
      if (value !== null) env[key] = value;
    }
    const { problem, shutdownMs } = configProblem(env);
    if (problem) problems.push(`${name}: its environment fails src/config.ts: ${problem}`);
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

// ------------------------------------------------------------------------------ Kubernetes

export interface K8sObject {
  apiVersion: string;
  kind: string;
  metadata: { name: string; namespace?: string; labels?: Record<string, string> };
  [key: string]: unknown;
}

/** The objects of a kustomization, rendered by kustomize when installed; `via` says how. */
export function loadKustomization(dir: string): { objects: K8sObject[]; via: string } {
  const tool = kustomizeTool();
  if (tool) {
    const args =
      tool[0]!.endsWith('kustomize') && tool.length === 1 ? ['build', dir] : [...tool.slice(1), dir];
    const result = spawnSync(tool[0]!, args, { encoding: 'utf8' });
    if (result.status !== 0) throw new Error(`${tool.join(' ')} failed: ${result.stderr}`);
    return { objects: parseAll(result.stdout), via: `${[tool[0], ...args.slice(0, -1)].join(' ')}` };
  }
  // Without kustomize: the listed resources with the kustomization's namespace, nothing more.
  const kustomization = YAML.parse(readFileSync(join(dir, 'kustomization.yaml'), 'utf8')) as {
    namespace?: string;
    resources: string[];
  };
  const objects = kustomization.resources.flatMap((file) => parseAll(readFileSync(join(dir, file), 'utf8')));
  for (const o of objects)
    if (kustomization.namespace && o.kind !== 'Namespace') o.metadata.namespace = kustomization.namespace;
  return { objects, via: 'YAML parser (no kustomize installed)' };
}

function parseAll(text: string): K8sObject[] {
  return YAML.parseAllDocuments(text)
    .map((doc) => doc.toJS() as K8sObject | null)
    .filter((o): o is K8sObject => o !== null);
}

interface Container {
  name: string;
  args?: string[];
  command?: string[];
  ports?: { name?: string; containerPort: number }[];
  env?: { name: string; value?: string; valueFrom?: unknown }[];
  envFrom?: { configMapRef?: { name: string }; secretRef?: { name: string } }[];
  readinessProbe?: { httpGet?: { path: string; port: string | number } };
  livenessProbe?: { httpGet?: { path: string; port: string | number } };
  resources?: { requests?: { memory?: string; cpu?: string }; limits?: { memory?: string } };
}

interface PodSpec {
  terminationGracePeriodSeconds?: number;
  initContainers?: Container[];
  containers: Container[];
  securityContext?: { runAsNonRoot?: boolean };
}

const matches = (selector: Record<string, string> | undefined, labels: Record<string, string> | undefined) =>
  !!selector &&
  Object.keys(selector).length > 0 &&
  Object.entries(selector).every(([k, v]) => labels?.[k] === v);

/** Everything wrong with the Kubernetes objects of Helios. */
export function checkKubernetes(
  objects: K8sObject[],
  accepted: Set<string>,
  commands: Set<string>,
  routes: Set<string>,
): string[] {
  const problems: string[] = [];
  const byKind = (kind: string) => objects.filter((o) => o.kind === kind);
  const data = (kind: string, name: string): Env | null => {
    const o = objects.find((x) => x.kind === kind && x.metadata.name === name) as
      (K8sObject & { data?: Env; stringData?: Env }) | undefined;
    if (!o) return null;
    const decoded = Object.fromEntries(
      Object.entries(o.data ?? {}).map(([k, v]) => [
        k,
        kind === 'Secret' ? Buffer.from(v, 'base64').toString() : v,
      ]),
    );
    return { ...decoded, ...(o.stringData ?? {}) };
  };
  const deployments = byKind('Deployment') as (K8sObject & {
    spec: {
      selector: { matchLabels: Record<string, string> };
      template: { metadata: { labels: Record<string, string> }; spec: PodSpec };
    };
  })[];
  if (deployments.length !== 1) problems.push(`expected one Deployment, found ${deployments.length}`);
  for (const deployment of deployments) {
    const name = `Deployment ${deployment.metadata.name}`;
    const pod = deployment.spec.template.spec;
    const labels = deployment.spec.template.metadata.labels;
    if (!matches(deployment.spec.selector.matchLabels, labels))
      problems.push(`${name}: selector does not match its pods`);
    if (pod.securityContext?.runAsNonRoot !== true) problems.push(`${name}: pods may run as root`);
    for (const kind of ['Service', 'PodDisruptionBudget']) {
      const objectsOfKind = byKind(kind);
      if (objectsOfKind.length === 0) problems.push(`no ${kind}`);
      for (const o of objectsOfKind) {
        const spec = o.spec as {
          selector?: Record<string, string> & { matchLabels?: Record<string, string> };
        };
        const selector = kind === 'Service' ? spec.selector : spec.selector?.matchLabels;
        if (!matches(selector, labels))
          problems.push(`${kind} ${o.metadata.name}: selector does not match ${name}'s pods`);
      }
    }
    const containers = [...(pod.initContainers ?? []), ...pod.containers];
    let shutdownMs = NaN;
    for (const container of containers) {
      const where = `${name}, container ${container.name}`;
      const args = container.args ?? [];
      if (container.command) problems.push(`${where}: overrides the image's entrypoint (helios)`);
      if (!commands.has(args[0] ?? ''))
        problems.push(`${where}: "${args.join(' ')}" is not a helios command`);
      const env: Env = {};
      for (const from of container.envFrom ?? []) {
        const [kind, ref] = from.configMapRef
          ? ['ConfigMap', from.configMapRef.name]
          : ['Secret', from.secretRef!.name];
        const values = data(kind, ref);
        if (!values) problems.push(`${where}: ${kind} ${ref} does not exist`);
        Object.assign(env, values ?? {});
      }
      const expanded = new Set<string>();
      for (const variable of container.env ?? []) {
        // Kubernetes expands $(NAME) of variables defined before; the downward API fills those.
        const value =
          variable.value?.replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (_, ref: string) => {
            expanded.add(ref);
            return env[ref] ?? `${ref.toLowerCase().replace(/_/g, '-')}-0`;
          }) ?? `${variable.name.toLowerCase().replace(/_/g, '-')}-0`;
        env[variable.name] = variable.name === 'POD_IP' ? '10.0.0.1' : value;
      }
      for (const key of Object.keys(env)) {
        if (!key.startsWith('HELIOS_')) {
          if (!expanded.has(key)) problems.push(`${where}: ${key} is not a HELIOS_* variable`);
        } else if (!accepted.has(key))
          problems.push(`${where}: ${key} is not a variable src/config.ts reads`);
      }
      const helios = Object.fromEntries(Object.entries(env).filter(([k]) => k.startsWith('HELIOS_')));
      const { problem, shutdownMs: ms } = configProblem(helios);
      if (problem) problems.push(`${where}: its environment fails src/config.ts: ${problem}`);
      if (args[0] !== 'node') continue;
      shutdownMs = ms;
      const ports = new Set((container.ports ?? []).map((p) => p.name ?? String(p.containerPort)));
      for (const [probe, path] of [
        ['readinessProbe', '/readyz'],
        ['livenessProbe', '/healthz'],
      ] as const) {
        const get = container[probe]?.httpGet;
        if (!get) problems.push(`${where}: no ${probe}`);
        else {
          if (get.path !== path) problems.push(`${where}: ${probe} asks ${get.path}, expected ${path}`);
          if (!routes.has(get.path)) problems.push(`${where}: ${probe} path ${get.path} is not served`);
          if (!ports.has(String(get.port)))
            problems.push(`${where}: ${probe} port ${get.port} is not a container port`);
        }
      }
      if (!container.resources?.requests?.memory || !container.resources.limits?.memory)
        problems.push(`${where}: no memory request and limit`);
      for (const service of byKind('Service')) {
        for (const port of (service.spec as { ports: { targetPort: string | number }[] }).ports)
          if (!ports.has(String(port.targetPort)))
            problems.push(
              `Service ${service.metadata.name}: targetPort ${port.targetPort} is not a container port`,
            );
      }
    }
    if (!pod.initContainers?.some((c) => c.args?.[0] === 'migrate'))
      problems.push(`${name}: no migrate init container`);
    const grace = pod.terminationGracePeriodSeconds ?? 30;
    if (!(grace * 1000 > shutdownMs))
      problems.push(
        `${name}: terminationGracePeriodSeconds ${grace} is not above HELIOS_SHUTDOWN_TIMEOUT_MS (${shutdownMs} ms)`,
      );
  }
  return problems;
}

// ------------------------------------------------------------------------------ Dockerfile

/** Everything wrong with the Dockerfile and .dockerignore. */
export function checkDockerfile(dockerfile: string, dockerignore: string, commands: Set<string>): string[] {
  const problems: string[] = [];
  const pkg = JSON.parse(readFileSync(join(REPO_ROOT, 'package.json'), 'utf8')) as {
    devDependencies: Record<string, string>;
  };
  const major = /(\d+)/.exec(pkg.devDependencies.node ?? '')?.[1];
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
  for (const from of froms)
    if (!from.startsWith(`node:${major}`))
      problems.push(`FROM ${from}: not Node.js ${major} (the pinned node devDependency)`);
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
