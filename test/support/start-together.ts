import type { IntegrationFixture } from './fixture.js';
import { untilServing } from './node-api.js';
import type { ManagedProcess } from './processes.js';

/** One node to start: its name, extra environment and what to wait for (see untilServing). */
export interface NodeSpec {
  readonly name: string;
  readonly extra?: Record<string, string>;
  readonly wait?: { leader?: boolean; worker?: boolean };
}

/**
 * Spawns every node at once (a node takes seconds to boot on a busy machine), then waits for each
 * in turn: each wait has its own timeout, so nodes that boot slowly because they boot together do
 * not exhaust one shared budget (on 2 busy cores three nodes took over 25 s to log a first line).
 */
export async function startTogether(
  fixture: IntegrationFixture,
  specs: readonly NodeSpec[],
): Promise<{ node: ManagedProcess; apiUrl: string }[]> {
  const nodes = specs.map((spec) => fixture.spawn(spec.name, spec.extra));
  const started: { node: ManagedProcess; apiUrl: string }[] = [];
  for (const [i, node] of nodes.entries()) {
    started.push({ node, apiUrl: await untilServing(node, specs[i]!.wait ?? {}) });
  }
  return started;
}
