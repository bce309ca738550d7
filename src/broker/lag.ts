import { Admin } from '@platformatic/kafka';
import { withTimeout } from '../errors.js';
import { baseOptions, type BrokerClient } from './client.js';

/** ListOffsets timestamps meaning "the log end offset" and "the earliest retained offset". */
const LATEST = -1n;
const EARLIEST = -2n;

/**
 * Messages of `topic` the consumer group has not committed yet: per partition, the end offset
 * (high watermark) minus the group's committed offset, summed. A partition the group never
 * committed counts from the earliest retained offset, because that is where such a group starts
 * (RunConsumer's `fromBeginning`); so does one whose commit fell below it (its records expired
 * while the workers were away): they are gone and will never be consumed. It reads the whole group's commits, not one member's, so the
 * leader can export one figure for the cluster. Opens its own admin connection and closes it:
 * the leader calls this every few seconds, and nothing else of the broker layer is involved.
 */
export async function consumerGroupLag(
  kafka: BrokerClient,
  groupId: string,
  topic: string,
  timeoutMs = 3000,
): Promise<number> {
  const admin = new Admin(baseOptions(kafka));
  try {
    return await withTimeout(
      (async () => {
        const { topics } = await admin.metadata({ topics: [topic] });
        const count = topics.get(topic)?.partitionsCount ?? 0;
        const partitions = Array.from({ length: count }, (_, i) => i);
        const offsetsAt = (timestamp: bigint) =>
          admin.listOffsets({
            topics: [{ name: topic, partitions: partitions.map((p) => ({ partitionIndex: p, timestamp })) }],
          });
        const [ends, starts, groups] = await Promise.all([
          offsetsAt(LATEST),
          offsetsAt(EARLIEST),
          admin.listConsumerGroupOffsets({
            groups: [{ groupId, topics: [{ name: topic, partitionIndexes: partitions }] }],
          }),
        ]);
        const endOf = offsetMap(ends[0]?.partitions ?? []);
        const startOf = offsetMap(starts[0]?.partitions ?? []);
        const committed = new Map(
          (groups[0]?.topics.find((t) => t.name === topic)?.partitions ?? []).map((p) => [
            p.partitionIndex,
            p.committedOffset,
          ]),
        );
        let lag = 0n;
        for (const p of partitions) {
          const end = endOf.get(p) ?? 0n;
          const at = committed.get(p) ?? -1n;
          const start = startOf.get(p) ?? 0n;
          // Records below the earliest retained offset are gone (retention, deleted records): the
          // group resumes at that offset, so a commit below it counts from there.
          const from = at > start ? at : start;
          if (end > from) lag += end - from;
        }
        return Number(lag);
      })(),
      timeoutMs,
      'reading the consumer lag',
    );
  } finally {
    await admin.close().catch(() => undefined);
  }
}

function offsetMap(partitions: { partitionIndex: number; offset: bigint }[]): Map<number, bigint> {
  return new Map(partitions.map((p) => [p.partitionIndex, p.offset]));
}
