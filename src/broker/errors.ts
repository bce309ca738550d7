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

interface ClientError {
  code?: unknown;
  apiId?: unknown;
  canRetry?: unknown;
  cause?: unknown;
  errors?: unknown;
}

/**
 * Every error in the chain: `@platformatic/kafka` nests the broker's answers in `MultipleErrors`
 * (an `AggregateError`: one per retry, or one per partition of a produce response) and in `cause`.
 */
function* chain(err: unknown, depth = 0): Generator<ClientError> {
  if (typeof err !== 'object' || err === null || depth > 6) return;
  const error = err as ClientError;
  yield error;
  if (Array.isArray(error.errors)) for (const nested of error.errors) yield* chain(nested, depth + 1);
  if (error.cause !== undefined) yield* chain(error.cause, depth + 1);
}

/** The broker's error name (e.g. `OUT_OF_ORDER_SEQUENCE_NUMBER`) of the first protocol error, if any. */
export function kafkaErrorType(err: unknown): string | undefined {
  for (const error of chain(err)) if (typeof error.apiId === 'string') return error.apiId;
  return undefined;
}

/** Transient: the client marks every error it may retry (network, timeouts, leader moves) `canRetry`. */
export function isRetriableKafkaError(err: unknown): boolean {
  let any = false;
  for (const error of chain(err)) {
    if (error.canRetry === false) return false;
    if (error.canRetry === true) any = true;
  }
  return any;
}

/**
 * True when the broker refused these messages for good (a protocol error it marks not retriable,
 * such as MESSAGE_TOO_LARGE or INVALID_RECORD) rather than being unreachable or slow: trying the
 * same messages again cannot help, but other messages may well go through.
 */
export function isBrokerRefusal(err: unknown): boolean {
  for (const error of chain(err)) {
    if (error.code === 'PLT_KFK_PROTOCOL' && error.canRetry === false) return true;
  }
  return false;
}
