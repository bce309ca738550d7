import { setTimeout as sleep } from 'node:timers/promises';
import type { Admin } from 'kafkajs';
import { toError, withTimeout } from '../errors.js';
import type { BrokerClient } from './client.js';
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

/** What {@link ensureTopics} found or made. */
export interface TopicState {
  name: string;
  /** Partitions the topic has now; may differ from the spec if it already existed. */
  partitions: number;
  /** True when this call created the topic (false for all when another node raced this call). */
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
    const missing = topics.filter((t) => !existing.has(t.name));
    // Only missing topics are requested: asking for existing ones makes the broker answer with
    // TOPIC_ALREADY_EXISTS, which kafkajs tolerates but logs as an error.
    const created = missing.length
      ? await admin.createTopics({
          topics: missing.map((t) => ({
            topic: t.name,
            numPartitions: t.partitions,
            replicationFactor: t.replicationFactor ?? 1,
            configEntries: Object.entries(t.config ?? {}).map(([name, value]) => ({ name, value })),
          })),
          waitForLeaders: false,
          timeout: timeoutMs,
        })
      : false;
    const partitions = await waitForLeaders(
      admin,
      topics.map((t) => t.name),
      signal,
    );
    return topics.map((t) => ({
      name: t.name,
      partitions: partitions.get(t.name) ?? 0,
      // kafkajs answers false when the broker reported TOPIC_ALREADY_EXISTS, i.e. a concurrent
      // creator won the race (for some topic: it does not say which).
      created: created && missing.includes(t),
    }));
  });
}

/** Deletes topics; unknown topics are ignored. Used by tests and tooling, never by a node. */
export async function deleteTopics(kafka: BrokerClient, names: string[], timeoutMs = 15_000): Promise<void> {
  await withAdmin(kafka, timeoutMs, 'delete Kafka topics', undefined, async (admin) => {
    const existing = new Set(await admin.listTopics());
    const present = names.filter((n) => existing.has(n));
    if (present.length) await admin.deleteTopics({ topics: present, timeout: timeoutMs });
  });
}

/**
 * Runs `work` with a connected admin client, bounded by `timeoutMs` (and ended early by `cancel`),
 * and always disconnects it. `signal` aborts when the call is over, so work abandoned by the
 * timeout stops polling instead of reconnecting the admin client in the background.
 */
async function withAdmin<T>(
  kafka: BrokerClient,
  timeoutMs: number,
  what: string,
  cancel: AbortSignal | undefined,
  work: (admin: Admin, signal: AbortSignal) => Promise<T>,
): Promise<T> {
  const admin = kafka.admin();
  const done = new AbortController();
  const onCancel = () => done.abort(cancel?.reason);
  cancel?.addEventListener('abort', onCancel, { once: true });
  try {
    cancel?.throwIfAborted();
    const cancelled = new Promise<never>((_, reject) => {
      done.signal.addEventListener('abort', () => reject(toError(done.signal.reason)), { once: true });
    });
    cancelled.catch(() => undefined); // only observed when cancel wins the race
    const working = (async () => {
      await admin.connect();
      return work(admin, done.signal);
    })();
    working.catch(() => undefined); // abandoned when the deadline or cancel wins
    return await withTimeout(Promise.race([working, cancelled]), timeoutMs, what);
  } finally {
    cancel?.removeEventListener('abort', onCancel);
    done.abort();
    await admin.disconnect().catch(() => undefined);
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
      const { topics } = await admin.fetchTopicMetadata({ topics: names });
      const ready = names.every((name) => {
        const topic = topics.find((t) => t.name === name);
        return topic && topic.partitions.length > 0 && topic.partitions.every((p) => p.leader >= 0);
      });
      if (ready) return new Map(topics.map((t) => [t.name, t.partitions.length]));
    } catch (err) {
      // Only transient metadata errors are worth waiting out; anything else is a real failure.
      if (!isRetriableKafkaError(err)) throw toError(err);
    }
    await sleep(LEADER_POLL_MS, undefined, { signal });
  }
}
