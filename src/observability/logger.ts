import { pino, type Logger } from 'pino';
import { redactHeaders, sensitiveHeaderSet } from '../security/sensitive-headers.js';

export type { Logger };

/** Header names whose values are secrets: redacted wherever they could be logged. */
const REDACT_PATHS = [
  'req.headers.authorization',
  'req.headers.cookie',
  'req.headers["proxy-authorization"]',
  'req.headers["x-api-key"]',
  'headers.authorization',
  'headers.cookie',
  'target.headers.authorization',
  'target.headers.cookie',
  '*.password',
  // An HTTP parser error's raw request bytes (an Authorization header, a job's secret headers).
  'err.rawPacket',
];

/** The process-wide logger: JSON lines on stdout (or `destination`), secrets redacted. */
export function createLogger(options: {
  level: string;
  nodeId: string;
  destination?: NodeJS.WritableStream;
  /** Header names whose values a logged `target` shows as `***` (any case); default the built-in set. */
  sensitiveHeaders?: ReadonlySet<string>;
}) {
  const sensitive = options.sensitiveHeaders ?? sensitiveHeaderSet();
  return pino(
    {
      level: options.level,
      base: { node: options.nodeId },
      redact: { paths: REDACT_PATHS, censor: '***' },
      // A job target logged whole (`{ target }`) keeps its shape, minus secrets, whatever their case.
      serializers: { target: (target: unknown) => redactTarget(target, sensitive) },
      timestamp: pino.stdTimeFunctions.isoTime,
    },
    options.destination,
  );
}

/** A logger that drops everything, for library users and unit tests that pass none. */
export const silentLogger: Logger = pino({ level: 'silent' });

function redactTarget(target: unknown, sensitive: ReadonlySet<string>): unknown {
  if (typeof target !== 'object' || target === null) return target;
  const headers = (target as { headers?: unknown }).headers;
  if (typeof headers !== 'object' || headers === null) return target;
  return { ...target, headers: redactHeaders(headers as Record<string, string>, sensitive) };
}
