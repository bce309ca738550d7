import { withTimeout } from '../errors.js';
import type { BrokerClient } from './client.js';

/**
 * Messages of `topic` the consumer group has not committed yet: per partition, the end offset
 * (high watermark) minus the group's committed offset, summed. A partition the group never
 * committed counts from the earliest retained offset, because that is where such a group starts
 * (RunConsumer's `fromBeginning`). Opens its own admin connection and closes it: the leader calls
 * this every few seconds, and nothing else of the broker layer is involved.
 */
export async function consumerGroupLag(
  kafka: BrokerClient,
  groupId: string,
  topic: string,
  timeoutMs = 3000,
): Promise<number> {
  const admin = kafka.admin();
  try {
    return await withTimeout(
      (async () => {
        await admin.connect();
        const [ends, committed] = await Promise.all([
          admin.fetchTopicOffsets(topic),
          admin.fetchOffsets({ groupId, topics: [topic] }),
        ]);
        const byPartition = new Map(
          (committed[0]?.partitions ?? []).map((p) => [p.partition, Number(p.offset)]),
        );
        let lag = 0;
        for (const end of ends) {
          const high = Number(end.high);
          const at = byPartition.get(end.partition) ?? -1;
          lag += Math.max(0, high - (at >= 0 ? at : Number(end.low)));
        }
        return lag;
      })(),
      timeoutMs,
      'reading the consumer lag',
    );
  } finally {
    await admin.disconnect().catch(() => undefined);
  }
}
