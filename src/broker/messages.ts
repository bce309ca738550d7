import type { IHeaders, KafkaMessage, Message } from 'kafkajs';

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

/** Converts our message to the client library's form. */
export function toKafkaMessage(message: OutgoingMessage): Message {
  return { key: message.key, value: message.value, headers: message.headers };
}

/** Converts a fetched message to ours, decoding key, value and headers as UTF-8. */
export function fromKafkaMessage(topic: string, partition: number, message: KafkaMessage): ConsumedMessage {
  return {
    topic,
    partition,
    offset: message.offset,
    key: message.key === null ? null : message.key.toString('utf8'),
    value: message.value === null ? null : message.value.toString('utf8'),
    headers: decodeHeaders(message.headers),
    timestamp: message.timestamp,
  };
}

function decodeHeaders(headers: IHeaders | undefined): Record<string, string> {
  const decoded: Record<string, string> = {};
  for (const [name, raw] of Object.entries(headers ?? {})) {
    // Kafka allows a header name to repeat (kafkajs then gives an array); we never produce that,
    // and for foreign messages the last value wins, as in most HTTP-style header maps.
    const value = Array.isArray(raw) ? raw.at(-1) : raw;
    if (value !== undefined) decoded[name] = value.toString();
  }
  return decoded;
}
