import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import YAML from 'yaml';
import { acceptedVariables, cliCommands, healthRoutes } from '../support/deploy/code.js';
import { checkCompose, loadCompose, parseCompose } from '../support/deploy/compose.js';
import { checkDockerfile, imageEnv } from '../support/deploy/dockerfile.js';
import {
  checkKubernetes,
  loadKustomization,
  parseAll,
  type K8sObject,
} from '../support/deploy/kubernetes.js';
import { REPO_ROOT } from '../support/env.js';

// No Docker engine or Kubernetes cluster runs here: the deployment files are checked against the
// code instead, through a real compose implementation's `config` (docker compose v2) and a real
// kustomize (or kubectl kustomize) when one is on the PATH, a YAML parser otherwise. Each test
// says which it used. The last tests break copies of the files to show each check can fail.

const accepted = acceptedVariables();
const commands = cliCommands();
const routes = healthRoutes();
const composeFile = join(REPO_ROOT, 'deploy/compose.yaml');
// The variables an operator must set (compose refuses to interpolate without them).
const composeEnv = {
  POSTGRES_PASSWORD: 'compose-test-password',
  HELIOS_API_TOKENS: 'compose-admin-token-0123:admin,compose-viewer-token-012:viewer',
};
const read = (path: string) => readFileSync(join(REPO_ROOT, path), 'utf8');

test('the accepted variables come from src/config/ and the CLI commands from helios --help', () => {
  for (const name of [
    'HELIOS_DATABASE_URL',
    'HELIOS_SHUTDOWN_TIMEOUT_MS',
    'HELIOS_RUN_RETENTION',
    'HELIOS_API_URL',
  ])
    assert.ok(accepted.has(name), name);
  assert.ok(!accepted.has('HELIOS_NOT_A_SETTING'));
  for (const name of ['node', 'migrate', 'fence', 'jobs', 'cluster']) assert.ok(commands.has(name), name);
  assert.ok(routes.has('/readyz') && routes.has('/healthz'));
});

test('deploy/compose.yaml: 3 nodes configured only by variables src/config/ accepts, on services that exist', (t) => {
  const { model, via } = loadCompose(composeFile, composeEnv);
  t.diagnostic(`compose file resolved by ${via}`);
  assert.deepEqual(checkCompose(model, accepted, commands, imageEnv(read('Dockerfile'))), []);
  const services = Object.keys(model.services);
  for (const name of ['postgres', 'etcd-1', 'etcd-2', 'etcd-3', 'kafka', 'helios-1', 'helios-2', 'helios-3'])
    assert.ok(services.includes(name), name);
  // Kafka's replication settings are variables of the file.
  const raw = read('deploy/compose.yaml');
  assert.match(raw, /KAFKA_DEFAULT_REPLICATION_FACTOR: \$\{KAFKA_REPLICATION_FACTOR:-1\}/);
  assert.match(raw, /HELIOS_KAFKA_REPLICATION_FACTOR: \$\{KAFKA_REPLICATION_FACTOR:-1\}/);
  const replicated = loadCompose(composeFile, { ...composeEnv, KAFKA_REPLICATION_FACTOR: '3' }).model;
  assert.equal(replicated.services.kafka!.environment!.KAFKA_DEFAULT_REPLICATION_FACTOR, '3');
  assert.equal(replicated.services['helios-2']!.environment!.HELIOS_KAFKA_REPLICATION_FACTOR, '3');
});

test('deploy/compose.yaml refuses to resolve without the password and the tokens', () => {
  assert.throws(() => loadCompose(composeFile, { POSTGRES_PASSWORD: 'x' }), /HELIOS_API_TOKENS/);
});

/** The rendered objects and the Secret the operator makes (secret.example.yaml), in its namespace. */
function withExampleSecret(objects: K8sObject[]): K8sObject[] {
  const secret = parseAll(read('deploy/kubernetes/secret.example.yaml')).map((o) => ({
    ...o,
    metadata: { ...o.metadata, namespace: 'helios' },
  }));
  return [...objects, ...secret];
}

test('deploy/kubernetes: probes, grace period, selectors and settings match the code', (t) => {
  const { objects, via } = loadKustomization(join(REPO_ROOT, 'deploy/kubernetes'));
  t.diagnostic(`kustomization rendered by ${via}`);
  // The Secret is the operator's, made once (secret.example.yaml shows it): an apply never
  // creates one with an example token nor overwrites theirs.
  assert.deepEqual(
    objects.filter((o) => o.kind === 'Secret'),
    [],
    'the kustomization applies no Secret',
  );
  assert.deepEqual(checkKubernetes(withExampleSecret(objects), accepted, commands, routes), []);
  const kinds = objects.map((o) => o.kind).sort();
  for (const kind of ['ConfigMap', 'Deployment', 'PodDisruptionBudget', 'Service'])
    assert.ok(kinds.includes(kind), kind);
  for (const o of objects) if (o.kind !== 'Namespace') assert.equal(o.metadata.namespace, 'helios', o.kind);
});

test('the Dockerfile: multi-stage, Node.js of the pinned major, non-root, production dependencies, /readyz', () => {
  assert.deepEqual(checkDockerfile(read('Dockerfile'), read('.dockerignore'), commands), []);
});

// ---- each check can fail: broken copies of the files are reported

test('the compose check reports an unknown variable, a missing service, a bad command and a short grace', () => {
  const broken = read('deploy/compose.yaml')
    .replace(
      'HELIOS_LOG_LEVEL: ${HELIOS_LOG_LEVEL:-info}',
      'HELIOS_LOG_LEVEL: info\n  HELIOS_NOT_A_SETTING: "1"',
    )
    .replace(
      '    etcd-3:\n      condition: service_started\n    kafka:',
      '    etcd-4:\n      condition: service_started\n    kafka:',
    )
    .replace(/( {2}helios-3:\n {4}<<: \*helios-node\n {4}command: \[)['"]node['"]/, "$1'serve'")
    .replace('stop_grace_period: 30s', 'stop_grace_period: 5s')
    .replace('HELIOS_NODE_ID: helios-2', 'HELIOS_NODE_ID: helios-2\n      HELIOS_WORKER_CONCURRENCY: "-3"');
  const problems = checkCompose(parseCompose(broken, composeEnv), accepted, commands).join('\n');
  assert.match(problems, /helios-1: HELIOS_NOT_A_SETTING is not a variable src\/config\/ reads/);
  assert.match(problems, /helios-2: depends on etcd-4, which is not a service/);
  assert.match(problems, /helios-3: command "serve" is not a helios command/);
  assert.match(problems, /helios-1: stop_grace_period is not above/);
  assert.match(problems, /helios-2: its environment fails src\/config\/: HELIOS_WORKER_CONCURRENCY/);
  assert.match(problems, /fewer than 3 Helios nodes/);
});

test('the Kubernetes check reports a wrong probe path, a short grace period, a PDB that selects nothing and an unknown key', () => {
  const { objects } = loadKustomization(join(REPO_ROOT, 'deploy/kubernetes'));
  const copy = structuredClone(withExampleSecret(objects)) as K8sObject[];
  const deployment = copy.find((o) => o.kind === 'Deployment') as unknown as {
    spec: {
      template: {
        spec: {
          terminationGracePeriodSeconds: number;
          containers: { readinessProbe: { httpGet: { path: string } } }[];
        };
      };
    };
  };
  deployment.spec.template.spec.terminationGracePeriodSeconds = 10;
  deployment.spec.template.spec.containers[0]!.readinessProbe.httpGet.path = '/ready';
  const pdb = copy.find((o) => o.kind === 'PodDisruptionBudget') as unknown as {
    spec: { selector: { matchLabels: Record<string, string> } };
  };
  pdb.spec.selector.matchLabels = { 'app.kubernetes.io/name': 'heliox' };
  const config = copy.find((o) => o.kind === 'ConfigMap') as unknown as { data: Record<string, string> };
  config.data.HELIOS_SHUTDOWN_TIMOUT_MS = '10000';
  const problems = checkKubernetes(copy, accepted, commands, routes).join('\n');
  assert.match(
    problems,
    /terminationGracePeriodSeconds 10 is not above HELIOS_SHUTDOWN_TIMEOUT_MS \(10000 ms\)/,
  );
  assert.match(problems, /readinessProbe asks \/ready, expected \/readyz/);
  assert.match(problems, /readinessProbe path \/ready is not served/);
  assert.match(problems, /PodDisruptionBudget helios: selector does not match/);
  assert.match(problems, /HELIOS_SHUTDOWN_TIMOUT_MS is not a variable src\/config\/ reads/);
});

test('the Dockerfile check reports root, another Node.js major and a missing health check', () => {
  const broken = read('Dockerfile')
    .replace('ARG NODE_IMAGE=node:24.21.0-bookworm-slim', 'ARG NODE_IMAGE=node:20-bookworm-slim')
    .replace('USER node', 'USER root')
    .replaceAll('/readyz', '/ready');
  const problems = checkDockerfile(broken, read('.dockerignore'), commands).join('\n');
  assert.match(problems, /node:20-bookworm-slim: not Node.js 24\.21\.0/);
  const floating = read('Dockerfile').replace('node:24.21.0-bookworm-slim', 'node:24-bookworm-slim');
  assert.match(
    checkDockerfile(floating, read('.dockerignore'), commands).join('\n'),
    /node:24-bookworm-slim: not Node.js 24\.21\.0/,
  );
  assert.match(problems, /runs as root/);
  assert.match(problems, /HEALTHCHECK does not ask \/readyz/);
  const ignored = checkDockerfile(read('Dockerfile'), `${read('.dockerignore')}\nsrc\n`, commands).join('\n');
  assert.match(ignored, /COPY src: excluded by .dockerignore/);
});

test('kustomization.yaml lists every manifest of the folder', () => {
  const listed = (YAML.parse(read('deploy/kubernetes/kustomization.yaml')) as { resources: string[] })
    .resources;
  const files = ['configmap.yaml', 'deployment.yaml', 'namespace.yaml', 'pdb.yaml', 'service.yaml'];
  assert.deepEqual([...listed].sort(), files);
});
