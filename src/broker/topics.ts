import { setTimeout as sleep } from 'node:timers/promises';
import { Admin, findErrorBy } from '@platformatic/kafka';
import { toError, withTimeout } from '../errors.js';
import { baseOptions, type BrokerClient } from './client.js';
import { isRetriableKafkaError } from './errors.js';

/** A topic Helios needs. */
export interface TopicSpec {
  name: string;
  /** Partition count used when the topic is created; an existing topic is never resized. */
  partitions: number;
  /** Default 1 (single-broker development clusters); production clusters want 3. */
  replicationFactor?: number;
  /** Topic-level configs, e.g. `{ 'retention.ms': '604800000' }`. */
  config?: Record<string, string>;
}

/**
 * The topics a node ensures. The runs topic gets HELIOS_KAFKA_PARTITIONS partitions: workers share
 * it by partition. The dead-letter topic gets one whatever that says: only runs that used up their
 * attempts go there, nothing in Helios consumes it, and one partition gives its readers every dead
 * letter in the order written.
 */
export function nodeTopics(kafka: {
  readonly runsTopic: string;
  readonly deadLetterTopic: string;
  readonly partitions: number;
  readonly replicationFactor: number;
}): TopicSpec[] {
  const { replicationFactor } = kafka;
  return [
    { name: kafka.runsTopic, partitions: kafka.partitions, replicationFactor },
    { name: kafka.deadLetterTopic, partitions: 1, replicationFactor },
  ];
}

/** What {@link ensureTopics} found or made. */
export interface TopicState {
  name: string;
  /** Partitions the topic has now; may differ from the spec if it already existed. */
  partitions: number;
  /** True when this call created the topic (false when it existed or another node raced this call). */
  created: boolean;
}

/** Pause between metadata polls while waiting for partition leaders. */
const LEADER_POLL_MS = 50;

/**
 * Creates the missing topics and waits until every partition of every listed topic has a leader,
 * so a producer or consumer started next does not race topic creation (the broker runs with
 * `auto.create.topics.enable=false`). Idempotent: topics that exist, or that another node creates
 * concurrently, are fine. Rejects with `TimeoutError` after `timeoutMs`.
 */
export async function ensureTopics(
  kafka: BrokerClient,
  topics: TopicSpec[],
  timeoutMs = 15_000,
  cancel?: AbortSignal,
): Promise<TopicState[]> {
  return withAdmin(kafka, timeoutMs, 'ensure Kafka topics', cancel, async (admin, signal) => {
    const existing = new Set(await admin.listTopics());
    const created = new Set<string>();
    for (const t of topics.filter((t) => !existing.has(t.name))) {
      signal.throwIfAborted();
      try {
        // One request per topic: the library applies one set of configs to all topics of a call.
        await admin.createTopics({
          topics: [t.name],
          partitions: t.partitions,
          replicas: t.replicationFactor ?? 1,
          configs: Object.entries(t.config ?? {}).map(([name, value]) => ({ name, value })),
        });
        created.add(t.name);
      } catch (err) {
        // Another node created it between our list and our create.
        if (!findErrorBy(toError(err), 'apiId', 'TOPIC_ALREADY_EXISTS')) throw toError(err);
      }
    }
    const partitions = await waitForLeaders(
      admin,
      topics.map((t) => t.name),
      signal,
    );
    return topics.map((t) => ({
      name: t.name,
      partitions: partitions.get(t.name) ?? 0,
      created: created.has(t.name),
    }));
  });
}

/** Deletes topics; unknown topics are ignored. Used by tests and tooling, never by a node. */
export async function deleteTopics(kafka: BrokerClient, names: string[], timeoutMs = 15_000): Promise<void> {
  await withAdmin(kafka, timeoutMs, 'delete Kafka topics', undefined, async (admin) => {
    const existing = new Set(await admin.listTopics());
    const present = names.filter((n) => existing.has(n));
    if (present.length) await admin.deleteTopics({ topics: present });
  });
}

/**
 * Runs `work` with an admin client, bounded by `timeoutMs` (and ended early by `cancel`), and
 * always closes it. `signal` aborts when the call is over, so work abandoned by the timeout stops
 * polling; closing the client ends its requests and retries in progress.
 */
async function withAdmin<T>(
  kafka: BrokerClient,
  timeoutMs: number,
  what: string,
  cancel: AbortSignal | undefined,
  work: (admin: Admin, signal: AbortSignal) => Promise<T>,
): Promise<T> {
  const admin = new Admin(baseOptions(kafka));
  const done = new AbortController();
  const onCancel = () => done.abort(cancel?.reason);
  cancel?.addEventListener('abort', onCancel, { once: true });
  try {
    cancel?.throwIfAborted();
    const cancelled = new Promise<never>((_, reject) => {
      done.signal.addEventListener('abort', () => reject(toError(done.signal.reason)), { once: true });
    });
    cancelled.catch(() => undefined); // only observed when cancel wins the race
    const working = work(admin, done.signal);
    working.catch(() => undefined); // abandoned when the deadline or cancel wins
    return await withTimeout(Promise.race([working, cancelled]), timeoutMs, what);
  } finally {
    cancel?.removeEventListener('abort', onCancel);
    done.abort();
    await admin.close().catch(() => undefined);
  }
}

/**
 * Polls metadata until every partition of `names` has a leader; returns partition counts.
 * A newly created KRaft topic is visible to the controller before the broker has loaded its
 * partitions, so the first answers may lack the topic or report LEADER_NOT_AVAILABLE.
 * The caller bounds the wait.
 */
async function waitForLeaders(
  admin: Admin,
  names: string[],
  signal: AbortSignal,
): Promise<Map<string, number>> {
  for (;;) {
    signal.throwIfAborted();
    try {
      const { topics } = await admin.metadata({ topics: names, forceUpdate: true });
      const ready = names.every((name) => {
        const topic = topics.get(name);
        return topic && topic.partitionsCount > 0 && topic.partitions.every((p) => p.leader >= 0);
      });
      if (ready) return new Map(names.map((name) => [name, topics.get(name)?.partitionsCount ?? 0]));
    } catch (err) {
      // Only transient metadata errors are worth waiting out; anything else is a real failure. The
      // client turns UNKNOWN_TOPIC_OR_PARTITION into a plain 'Unknown topic' error: here it only
      // means the broker has not loaded the topic we just created.
      if (!isRetriableKafkaError(err) && !toError(err).message.startsWith('Unknown topic'))
        throw toError(err);
    }
    await sleep(LEADER_POLL_MS, undefined, { signal });
  }
}
