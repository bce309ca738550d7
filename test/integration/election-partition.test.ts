import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { serverEnv } from '../support/env.js';
import { integrationFixture, type IntegrationFixture } from '../support/fixture.js';
import type { LogLine } from '../support/processes.js';
import { startTogether } from '../support/start-together.js';
import { TcpProxy } from '../support/tcp-proxy.js';

// README, "At most one leader acts at a time": a leader stops at its own monotonic deadline
// (last renewal that succeeded + TTL − safety margin), before its lease can expire at etcd. A
// leader cut off from etcd (every packet dropped, no reset: it hears nothing) must therefore have
// stepped down before another node can become leader.

const TTL_MS = 3000;
const SAFETY_MARGIN_MS = 500;

let fixture: IntegrationFixture;
/** Each node reaches etcd through its own proxy, so whichever leads can be cut off alone. */
const proxies: TcpProxy[] = [];

before(async () => {
  fixture = await integrationFixture();
  const etcd = new URL(serverEnv().etcdEndpoints.split(',')[0]!);
  for (let i = 0; i < 2; i++) {
    const proxy = new TcpProxy(etcd.hostname, Number(etcd.port));
    await proxy.listen();
    proxies.push(proxy);
  }
});
after(async () => {
  // Healed first, so the cut-off node can stop cleanly.
  for (const proxy of proxies) await proxy.close();
  await fixture.teardown();
});

const at = (line: LogLine) => Date.parse(line.time as string);

test(
  'a leader cut off from etcd steps down before its lease expires: before the next leader begins',
  { timeout: 60_000 },
  async () => {
    const settings = {
      HELIOS_ROLES: 'scheduler,api',
      HELIOS_LEASE_TTL_MS: String(TTL_MS),
      HELIOS_LEADER_SAFETY_MARGIN_MS: String(SAFETY_MARGIN_MS),
    };
    // Started together (a node takes seconds to boot on a busy machine); one of them leads.
    const nodes = await startTogether(
      fixture,
      proxies.map((proxy, i) => ({
        name: `part-${i + 1}`,
        extra: { ...settings, HELIOS_ETCD_ENDPOINTS: `http://127.0.0.1:${proxy.port}` },
      })),
    );
    const leading = await Promise.any(
      nodes.map(async ({ node }, i) => {
        await node.waitForLog((l) => l.msg === 'became leader', 30_000);
        return i;
      }),
    );
    const first = nodes[leading]!;
    const second = nodes[1 - leading]!;
    const proxy = proxies[leading]!;

    const cutAt = Date.now();
    proxy.cut();
    const steppedDown = await first.node.waitForLog((l) => l.msg === 'stepped down', 20_000);
    const became = await second.node.waitForLog((l) => l.msg === 'became leader', 20_000);

    const stepDownMs = at(steppedDown) - cutAt;
    const gapMs = at(became) - at(steppedDown);
    console.log(`# stepped down ${stepDownMs} ms after the cut; next leader ${gapMs} ms after that`);
    assert.ok(
      at(steppedDown) < at(became),
      `the cut-off leader stepped down ${-gapMs} ms after the next leader began`,
    );
    // Its own deadline, not etcd, ended the epoch: within TTL − margin of its last renewal, and
    // that renewal was at most a third of the TTL before the cut (plus a timer's lateness).
    assert.ok(stepDownMs < TTL_MS, `stepped down ${stepDownMs} ms after the cut`);
    assert.ok(
      ['deadline', 'keepalive-failed'].includes(steppedDown.reason as string),
      `stepped down for ${String(steppedDown.reason)}`,
    );
  },
);
