import type { Message, MessageToProduce } from '@platformatic/kafka';

/** A message to publish. Messages with the same key go to the same partition, in order. */
export interface OutgoingMessage {
  key: string;
  value: string;
  /** UTF-8 string headers, e.g. a trace id or a schema version. */
  headers?: Record<string, string>;
}

/** Where a published batch landed. */
export interface PublishReceipt {
  topic: string;
  partition: number;
  /** Offset of the first message of the batch in that partition (decimal int64). */
  baseOffset: string;
}

/** A message delivered to a {@link RunConsumer} handler. */
export interface ConsumedMessage {
  topic: string;
  partition: number;
  /** Offset in the partition (decimal int64, as Kafka offsets exceed 2^53). */
  offset: string;
  /** Null only for messages produced without a key by some other client. */
  key: string | null;
  /** Null only for tombstones produced by some other client. */
  value: string | null;
  headers: Record<string, string>;
  /** Broker or producer timestamp, ms since the epoch (decimal). */
  timestamp: string;
}

/** Converts our message to the client library's form (string serialisers). */
export function toKafkaMessage(
  topic: string,
  message: OutgoingMessage,
): MessageToProduce<string, string, string, string> {
  return { topic, key: message.key, value: message.value, headers: message.headers };
}

/** Converts a fetched message (string deserialisers) to ours. */
export function fromKafkaMessage(message: Message<string, string, string, string>): ConsumedMessage {
  const headers: Record<string, string> = {};
  // Kafka allows a header name to repeat; we never produce that, and for foreign messages the last
  // value wins, as in most HTTP-style header maps.
  for (const [name, value] of message.headerEntries) headers[name] = value ?? '';
  return {
    topic: message.topic,
    partition: message.partition,
    offset: message.offset.toString(),
    key: message.key ?? null,
    value: message.value ?? null,
    headers,
    timestamp: message.timestamp.toString(),
  };
}
