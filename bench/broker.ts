/**
 * The broker module alone, on the local Kafka: publish throughput of `RunPublisher` and the time
 * a worker's intake needs to deliver again after a broker restart. It loads the *built* module
 * from `--dist` (default `dist`), so two builds (two Kafka clients) can be measured in turn on the
 * same broker. Restarts the local Kafka (`scripts/infra.sh down kafka && up kafka`).
 *
 *   npm run build && npx tsx bench/broker.ts [--dist dist] [--seconds 8] [--skip-restart]
 */
import { execFileSync } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { resolve } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import type * as Broker from '../src/broker/index.js';
import type * as Intake from '../src/execution/intake.js';
import type * as Log from '../src/observability/logger.js';
import { serverEnv } from '../test/support/env.js';

const { values } = parseArgs({
  options: {
    dist: { type: 'string', default: 'dist' },
    seconds: { type: 'string', default: '8' },
    'skip-restart': { type: 'boolean', default: false },
  },
});
const dist = resolve(values.dist);
const load = async <T>(path: string) => (await import(pathToFileURL(`${dist}/${path}`).href)) as T;
const broker = await load<typeof Broker>('broker/index.js');
const { KafkaIntake } = await load<typeof Intake>('execution/intake.js');
const { silentLogger } = await load<typeof Log>('observability/logger.js');

const brokers = serverEnv().kafkaBrokers.split(',');
const tag = randomUUID().slice(0, 8);
const kafka = broker.createKafka({ brokers, clientId: `bench-broker-${tag}`, logger: silentLogger });
const topic = `helios-bench.broker.${tag}`;
// The restart phase has a topic of its own: a backlog left by the throughput phase would measure
// how fast the intake drains it, not how fast it comes back.
const restartTopic = `${topic}.restart`;
await broker.ensureTopics(kafka, [
  { name: topic, partitions: 6 },
  { name: restartTopic, partitions: 6 },
]);
const seconds = Number(values.seconds);

const runMessage = (i: number) => ({
  key: randomUUID(),
  value: JSON.stringify({
    runId: randomUUID(),
    jobId: randomUUID(),
    attempt: 1,
    scheduledFor: new Date().toISOString(),
    seq: i,
  }),
});

/** Sequential publishes of `batch` messages for `seconds` (the relay publishes one batch at a time). */
async function throughput(batch: number): Promise<number> {
  const publisher = new broker.RunPublisher({ kafka, logger: silentLogger });
  await publisher.connect();
  await publisher.publish(topic, [runMessage(0)]); // warm-up: metadata and leader connection
  let sent = 0;
  const t0 = performance.now();
  while (performance.now() - t0 < seconds * 1000) {
    await publisher.publish(
      topic,
      Array.from({ length: batch }, (_, i) => runMessage(i)),
    );
    sent += batch;
  }
  const rate = sent / ((performance.now() - t0) / 1000);
  await publisher.disconnect();
  return rate;
}

function infra(...args: string[]): void {
  execFileSync('bash', ['scripts/infra.sh', ...args], { stdio: 'ignore' });
}

/** Broker restart → the first message published after it reaches a worker's intake. */
async function rejoinAfterRestart(): Promise<{ rejoinMs: number; downMs: number }> {
  const accepted = new Set<string>();
  const intake = new KafkaIntake({
    kafka,
    topic: restartTopic,
    groupId: `helios-bench.broker.${tag}.${randomUUID().slice(0, 4)}`,
    instanceId: `bench-${tag}`,
    logger: silentLogger,
    accept: (m) => void accepted.add(m.runId),
  });
  const publisher = new broker.RunPublisher({ kafka, logger: silentLogger, sendTimeoutMs: 2_000 });
  const probe = async (deadlineMs: number): Promise<number> => {
    const t0 = performance.now();
    for (let i = 0; performance.now() - t0 < deadlineMs; i++) {
      const m = runMessage(i);
      const runId = (JSON.parse(m.value) as { runId: string }).runId;
      const published = await publisher.publish(restartTopic, [m]).then(
        () => true,
        () => false,
      );
      if (published) {
        const sentAt = performance.now();
        while (performance.now() - sentAt < 500) {
          if (accepted.has(runId)) return performance.now() - t0;
          await sleep(5);
        }
      } else await sleep(100);
    }
    return NaN;
  };
  intake.start();
  try {
    if (Number.isNaN(await probe(30_000))) throw new Error('intake never delivered before the restart');
    const down = performance.now();
    infra('down', 'kafka');
    infra('up', 'kafka');
    const up = performance.now();
    return { rejoinMs: await probe(60_000), downMs: up - down };
  } finally {
    await publisher.disconnect();
    await intake.stop();
  }
}

try {
  const single = await throughput(1);
  const batch100 = await throughput(100);
  const batch1000 = await throughput(1000);
  console.log(
    `[broker ${values.dist}] publish, sequential: 1 msg/publish ${single.toFixed(0)} msg/s; ` +
      `100/publish ${batch100.toFixed(0)} msg/s; 1000/publish ${batch1000.toFixed(0)} msg/s`,
  );
  if (!values['skip-restart']) {
    const { rejoinMs, downMs } = await rejoinAfterRestart();
    console.log(
      `[broker ${values.dist}] broker restart (down+up ${(downMs / 1000).toFixed(1)} s) → intake delivers again after ${rejoinMs.toFixed(0)} ms`,
    );
  }
} finally {
  await broker.deleteTopics(kafka, [topic, restartTopic]).catch(() => undefined);
}
