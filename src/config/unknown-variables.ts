import leven from 'leven';
import type { Env } from './env.js';
import { loadCliConfig, loadConfig } from './index.js';

// A setting whose name is misspelt (HELIOS_WORKER_CONCURENCY) is not an error: nothing reads it,
// and the node runs on the default, silently. Nor can it be refused at start: after a rollback, a
// variable the newer release added is one the older does not know, and the nodes must still
// start. So `helios node`, `migrate` and `fence` warn of every HELIOS_* variable no setting reads,
// naming the setting it is nearest to.

/**
 * Variables with the HELIOS_ prefix that are no setting of a node or of the CLI: the project's own
 * scripts (scripts/infra.sh, scripts/cluster.sh), deployment files (deploy/compose.yaml),
 * benchmarks and tests set them, often in the same shell as a node (`source .helios/env`).
 * test/unit/unknown-variables.test.ts keeps this list complete.
 */
export const TOOL_VARIABLES: ReadonlySet<string> = new Set([
  // scripts/infra.sh and the chaos run's network namespaces
  'HELIOS_INFRA',
  'HELIOS_STATE_DIR',
  'HELIOS_PG_BIN',
  'HELIOS_PG_PORT',
  'HELIOS_ETCD_PORT',
  'HELIOS_ETCD_PEER_PORT',
  'HELIOS_KAFKA_PORT',
  'HELIOS_KAFKA_CONTROLLER_PORT',
  'HELIOS_KAFKA_HEAP',
  'HELIOS_KAFKA_READY_SECONDS',
  'HELIOS_KAFKA_NETNS_PORT',
  'HELIOS_NETNS_HOST',
  // scripts/cluster.sh
  'HELIOS_NODES',
  'HELIOS_CLUSTER_BASE_PORT',
  'HELIOS_DEMO_TARGET_PORT',
  // deploy/compose.yaml
  'HELIOS_IMAGE',
  'HELIOS_1_PORT',
  'HELIOS_2_PORT',
  'HELIOS_3_PORT',
  // bench/ (modules preloaded into the benchmarks' nodes) and test/
  'HELIOS_BENCH_PROBE_DIR',
  'HELIOS_BENCH_PROBE_MS',
  'HELIOS_BENCH_PROFILE_DIR',
  'HELIOS_MIXED_OLD',
  'HELIOS_MIXED_OLD_DIR',
  'HELIOS_MIXED_ORDER',
  'HELIOS_MIXED_SEED',
  'HELIOS_TEST_CONCURRENCY',
  'HELIOS_TEST_HOLD',
  'HELIOS_TEST_LOG',
]);

/**
 * Every variable a setting reads: the node's config and the CLI's, found by loading them from an
 * environment that records each name looked up (with the three required settings given), so the
 * list cannot drift from the loaders.
 */
export function settingNames(): Set<string> {
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

/** A HELIOS_* variable no setting reads, and the setting its name is nearest to, if one is near. */
export interface UnknownVariable {
  readonly name: string;
  readonly nearest?: string;
}

/** Edits (letters added, dropped or changed) within which a name is taken for a setting misspelt. */
const NEAR_EDITS = 3;

/** The HELIOS_* variables of `env` that are neither settings nor {@link TOOL_VARIABLES}, by name. */
export function unknownVariables(env: Env): UnknownVariable[] {
  const settings = settingNames();
  return Object.keys(env)
    .filter((name) => name.startsWith('HELIOS_') && !settings.has(name) && !TOOL_VARIABLES.has(name))
    .sort()
    .map((name) => {
      let nearest: string | undefined;
      let edits = NEAR_EDITS + 1;
      for (const setting of settings) {
        const distance = leven(name, setting, { maxDistance: edits });
        if (distance < edits) [nearest, edits] = [setting, distance];
      }
      return nearest === undefined ? { name } : { name, nearest };
    });
}
