/** A publish to Kafka failed; the messages may or may not have been written, so retry it. */
export class PublishError extends Error {
  override name = 'PublishError';
  constructor(
    readonly topic: string,
    readonly count: number,
    options: ErrorOptions,
  ) {
    super(`publishing ${count} message(s) to ${topic} failed`, options);
  }
}

/** The `type` kafkajs gives protocol errors (e.g. `OUT_OF_ORDER_SEQUENCE_NUMBER`), if any. */
export function kafkaErrorType(err: unknown): string | undefined {
  const type = typeof err === 'object' && err !== null ? (err as { type?: unknown }).type : undefined;
  return typeof type === 'string' ? type : undefined;
}

/** kafkajs marks transient protocol and connection errors with `retriable: true`. */
export function isRetriableKafkaError(err: unknown): boolean {
  return typeof err === 'object' && err !== null && (err as { retriable?: unknown }).retriable === true;
}

/**
 * True when the broker refused these messages for good (a protocol error it marks not retriable,
 * such as MESSAGE_TOO_LARGE or INVALID_RECORD) rather than being unreachable or slow: trying the
 * same messages again cannot help, but other messages may well go through.
 */
export function isBrokerRefusal(err: unknown): boolean {
  for (let cause: unknown = err, depth = 0; cause && depth < 5; depth++) {
    if (kafkaErrorType(cause) !== undefined && !isRetriableKafkaError(cause)) return true;
    cause = (cause as { cause?: unknown }).cause;
  }
  return false;
}
