import { logLevel, type LogEntry, type logCreator } from 'kafkajs';
import type { Logger } from '../observability/logger.js';

/** The kafkajs level that lets through exactly what our pino logger would print. */
export function kafkaLogLevel(logger: Logger): logLevel {
  if (logger.isLevelEnabled('debug')) return logLevel.DEBUG;
  if (logger.isLevelEnabled('info')) return logLevel.INFO;
  if (logger.isLevelEnabled('warn')) return logLevel.WARN;
  if (logger.isLevelEnabled('error')) return logLevel.ERROR;
  return logLevel.NOTHING;
}

/**
 * Routes kafkajs log entries to `logger` as structured pino records (`kafka: <namespace>`).
 *
 * kafkajs logs every protocol error response at ERROR in its `Connection` namespace, including
 * ones it handles itself (coordinator still loading, group rebalancing, topic already exists).
 * Those become `warn`: a failure that matters surfaces again, at ERROR, from the retrier, the
 * consumer crash handler or our own callers.
 */
export function pinoLogCreator(logger: Logger): logCreator {
  const kafkaLogger = logger.child({ component: 'kafkajs' });
  return () => (entry: LogEntry) => {
    // kafkajs's own timestamp and logger name duplicate pino's fields.
    const { message, timestamp: _timestamp, logger: _name, ...extra } = entry.log;
    const fields: Record<string, unknown> = { kafka: entry.namespace, ...extra };
    // kafkajs passes Error objects as `error`; pino serialises them (stack included) only as `err`.
    if (fields.error instanceof Error) {
      fields.err = fields.error;
      delete fields.error;
    }
    switch (entry.level) {
      case logLevel.ERROR:
        if (entry.namespace === 'Connection') kafkaLogger.warn(fields, message);
        else kafkaLogger.error(fields, message);
        break;
      case logLevel.WARN:
        kafkaLogger.warn(fields, message);
        break;
      case logLevel.INFO:
        kafkaLogger.info(fields, message);
        break;
      default:
        kafkaLogger.debug(fields, message);
    }
  };
}
