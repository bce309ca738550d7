import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import YAML from 'yaml';
import { configProblem, findTool, type Env } from './code.js';

// deploy/kubernetes/: rendered by kustomize when one is installed.

/** `kustomize`, or the one built into kubectl, when installed. */
export function kustomizeTool(): string[] | null {
  return findTool(['kustomize']) ?? findTool(['kubectl'], ['kustomize'], ['version', '--client']);
}

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

export function parseAll(text: string): K8sObject[] {
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
        } else if (!accepted.has(key)) problems.push(`${where}: ${key} is not a variable src/config/ reads`);
      }
      const helios = Object.fromEntries(Object.entries(env).filter(([k]) => k.startsWith('HELIOS_')));
      const { problem, shutdownMs: ms } = configProblem(helios);
      if (problem) problems.push(`${where}: its environment fails src/config/: ${problem}`);
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
