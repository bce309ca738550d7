/**
 * A worker process killed (SIGKILL: no LeaveGroup) and started again: how long until its
 * successor holds partitions again, with a surviving member in the group. Compares a dynamic
 * member, a static member (KIP-345, same group.instance.id) and, with `--kip848`, the consumer
 * group protocol (KIP-848). Uses `@platformatic/kafka` directly (the measured choice of
 * `src/broker/consumer.ts` is static membership on the classic protocol).
 *
 *   npx tsx bench/rejoin.ts [--kip848] [--tries 3]
 */
import { fork } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { once } from 'node:events';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { Consumer, type ConsumerOptions } from '@platformatic/kafka';
import { createKafka, deleteTopics, ensureTopics } from '../src/broker/index.js';
import { silentLogger } from '../src/observability/logger.js';
import { median } from './lib/stats.js';
import { serverEnv } from '../test/support/env.js';

const brokers = serverEnv().kafkaBrokers.split(',');
type Mode = 'dynamic' | 'static' | 'kip848' | 'kip848-static';

function options(
  mode: Mode,
  groupId: string,
  instanceId: string,
): ConsumerOptions<Buffer, Buffer, Buffer, Buffer> {
  const base = {
    clientId: `rejoin-${instanceId}`,
    bootstrapBrokers: brokers,
    groupId,
    maxWaitTime: 500,
    autocommit: false,
  };
  const staticId = mode === 'static' || mode === 'kip848-static' ? { groupInstanceId: instanceId } : {};
  if (mode.startsWith('kip848')) return { ...base, ...staticId, groupProtocol: 'consumer' };
  return { ...base, ...staticId, sessionTimeout: 6_000, rebalanceTimeout: 6_000, heartbeatInterval: 1_000 };
}

/** Joins and returns the time until this member holds at least one partition of `topic`. */
async function join(
  mode: Mode,
  groupId: string,
  instanceId: string,
  topic: string,
): Promise<{ ms: number; c: Consumer }> {
  const t0 = performance.now();
  const c = new Consumer(options(mode, groupId, instanceId));
  c.on('error', () => undefined);
  const stream = await c.consume({ topics: [topic], mode: 'latest', autocommit: false });
  stream.on('data', () => undefined);
  stream.on('error', () => undefined);
  while (!(c.assignments ?? []).some((a) => a.topic === topic && a.partitions.length > 0)) {
    await new Promise((r) => setTimeout(r, 10));
  }
  return { ms: performance.now() - t0, c };
}

if (process.argv[2] === '--child') {
  const [, , , mode, groupId, instanceId, topic] = process.argv;
  await join(mode as Mode, groupId!, instanceId!, topic!);
  process.send?.('joined');
  await new Promise(() => undefined); // killed by the parent
} else {
  const { values } = parseArgs({
    options: { kip848: { type: 'boolean' }, tries: { type: 'string', default: '3' } },
  });
  const kafka = createKafka({ brokers, clientId: 'bench-rejoin', logger: silentLogger });
  const topic = `helios-bench.rejoin.${randomUUID().slice(0, 8)}`;
  await ensureTopics(kafka, [{ name: topic, partitions: 6 }]);
  const modes: Mode[] = values.kip848 ? ['kip848', 'kip848-static'] : ['dynamic', 'static'];
  try {
    for (const mode of modes) {
      const times: number[] = [];
      for (let i = 0; i < Number(values.tries); i++) {
        const groupId = `helios-bench.rejoin.${randomUUID()}`;
        const survivor = await join(mode, groupId, 'survivor', topic);
        const child = fork(fileURLToPath(import.meta.url), ['--child', mode, groupId, 'worker', topic], {
          execArgv: ['--import', 'tsx'],
        });
        await once(child, 'message');
        // Let the group settle with both members holding partitions.
        while ((survivor.c.assignments?.[0]?.partitions.length ?? 6) === 6)
          await new Promise((r) => setTimeout(r, 20));
        child.kill('SIGKILL');
        await once(child, 'exit');
        const successor = await join(mode, groupId, 'worker', topic);
        times.push(successor.ms);
        await successor.c.close(true);
        await survivor.c.close(true);
      }
      console.log(
        `[rejoin] ${mode}: killed worker's successor holds partitions after ${times.map((t) => t.toFixed(0)).join(', ')} ms (median ${median(times).toFixed(0)})`,
      );
    }
  } finally {
    await deleteTopics(kafka, [topic]).catch(() => undefined);
  }
}
