import { Admin } from '@platformatic/kafka';
import { withTimeout } from '../errors.js';
import { baseOptions, type BrokerClient } from './client.js';

/** A consumer group as the coordinator sees it. */
export interface GroupState {
  /** Coordinator state: `Stable`, `PreparingRebalance`, `CompletingRebalance`, `Empty`, `Dead`. */
  state: string;
  /** Member ids, with the static instance id of each member that has one. */
  members: { memberId: string; groupInstanceId: string | null }[];
}

/** Describes one consumer group. Used by tests, benchmarks and tooling, never by a node. */
export async function describeGroup(
  kafka: BrokerClient,
  groupId: string,
  timeoutMs = 5_000,
): Promise<GroupState> {
  const admin = new Admin(baseOptions(kafka));
  try {
    const groups = await withTimeout(
      admin.describeGroups({ groups: [groupId] }),
      timeoutMs,
      'describe group',
    );
    const group = groups.get(groupId);
    return {
      state: group?.state ?? 'Dead',
      members: [...(group?.members.values() ?? [])].map((m) => ({
        memberId: m.id,
        groupInstanceId: m.groupInstanceId ?? null,
      })),
    };
  } finally {
    await admin.close().catch(() => undefined);
  }
}
