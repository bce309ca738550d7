import assert from 'node:assert/strict';
import type { Etcd3 } from 'etcd3';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { createTestDatabase, type TestDatabase } from './database.js';
import { serverEnv, uniqueId } from './env.js';
import { TargetServer, type Behaviour } from './execution.js';
import { untilServing } from './node-api.js';
import { spawnNode, stopAll, type ManagedProcess, type NodeEnv } from './processes.js';

/**
 * What an integration test file shares: its own database (cloned from the migrated template), etcd
 * prefix and topic names, a recording target, the nodes it starts. `teardown()` stops everything
 * in reverse order and fails the test if a node is still running afterwards.
 */
export interface IntegrationFixture {
  readonly db: TestDatabase;
  readonly etcd: Etcd3;
  readonly etcdPrefix: string;
  readonly topic: string;
  readonly target: TargetServer;
  readonly nodes: ManagedProcess[];
  /** The environment a node of this fixture runs with (add `extra` per node). */
  env(extra?: Record<string, string>): NodeEnv;
  /** Spawns a node of this fixture (not waited for). */
  spawn(name: string, extra?: Record<string, string>): ManagedProcess;
  /** Spawns a node and waits until it serves, and (as `wait` says) leads and consumes. */
  start(
    name: string,
    extra?: Record<string, string>,
    wait?: { leader?: boolean; worker?: boolean },
  ): Promise<{ node: ManagedProcess; apiUrl: string }>;
  teardown(): Promise<void>;
}

export async function integrationFixture(
  options: { empty?: boolean; behaviour?: Behaviour } = {},
): Promise<IntegrationFixture> {
  const db = await createTestDatabase({ empty: options.empty ?? false });
  const etcd = createEtcdClient(serverEnv().etcdEndpoints.split(','));
  const etcdPrefix = `/helios-test/${uniqueId()}`;
  const topic = `helios.test.${uniqueId()}`;
  const target = new TargetServer(options.behaviour);
  await target.start();
  const nodes: ManagedProcess[] = [];
  const env = (extra?: Record<string, string>): NodeEnv => ({
    databaseUrl: db.url,
    etcdPrefix,
    topic,
    ...(extra ? { extra } : {}),
  });
  const spawn = (name: string, extra?: Record<string, string>) => {
    const node = spawnNode(name, env(extra));
    nodes.push(node);
    return node;
  };
  return {
    db,
    etcd,
    etcdPrefix,
    topic,
    target,
    nodes,
    env,
    spawn,
    async start(name, extra, wait) {
      // Recorded before waiting: a node that never becomes ready is still stopped by teardown.
      const node = spawn(name, extra);
      return { node, apiUrl: await untilServing(node, wait) };
    },
    async teardown() {
      // Jobs off first: nodes that stop one after another would otherwise go on dispatching and
      // executing for the ones still running (and a late call could reach a closed target).
      await db.pool.query('UPDATE jobs SET enabled = false').catch(() => undefined);
      await stopAll(nodes);
      await target.close();
      await db.drop();
      await etcd.delete().prefix(etcdPrefix);
      etcd.close();
      const running = nodes.filter((n) => n.exitedAt === undefined).map((n) => n.name);
      assert.deepEqual(running, [], 'no node of this file is left running');
    },
  };
}
