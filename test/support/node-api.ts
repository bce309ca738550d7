import assert from 'node:assert/strict';
import { spawnNode, type ManagedProcess, type NodeEnv } from './processes.js';

/**
 * Spawns a node (dist/main.js) and waits until it serves its API and, as its roles say, leads and
 * has joined the workers' consumer group. Returns the process and its API URL.
 */
export async function startNode(
  name: string,
  env: NodeEnv,
  wait: { leader?: boolean; worker?: boolean } = { leader: true, worker: true },
): Promise<{ node: ManagedProcess; apiUrl: string }> {
  const node = spawnNode(name, env);
  return { node, apiUrl: await untilServing(node, wait) };
}

/** Waits until a spawned node serves its API (and leads, and consumes, as `wait` says); its API URL. */
export async function untilServing(
  node: ManagedProcess,
  wait: { leader?: boolean; worker?: boolean } = { leader: true, worker: true },
): Promise<string> {
  const started = await node.waitForLog((l) => l.msg === 'node started', 30_000);
  if (wait.leader) await node.waitForLog((l) => l.msg === 'became leader', 30_000);
  if (wait.worker) await node.waitForLog((l) => l.msg === 'joined consumer group', 30_000);
  return started.apiUrl as string;
}

/** Calls a node's REST API (open mode) with a JSON body; fails the test unless it answers 2xx. */
export async function apiCall<T>(apiUrl: string, method: string, path: string, body?: unknown): Promise<T> {
  const response = await fetch(`${apiUrl}/api/v1${path}`, {
    method,
    headers: { 'content-type': 'application/json' },
    body: method === 'GET' ? undefined : JSON.stringify(body ?? {}),
  });
  const text = await response.text();
  assert.ok(response.status < 300, `${method} ${path}: ${response.status} ${text}`);
  return JSON.parse(text) as T;
}
