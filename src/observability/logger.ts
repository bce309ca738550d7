import { pino, type Logger } from 'pino';

export type { Logger };

/** Header names whose values are secrets: redacted wherever they could be logged. */
const REDACT_PATHS = [
  'req.headers.authorization',
  'req.headers.cookie',
  'headers.authorization',
  'headers.cookie',
  'target.headers.authorization',
  'target.headers.cookie',
  '*.password',
];

/** The process-wide logger: JSON lines on stdout (or `destination`), secrets redacted. */
export function createLogger(options: {
  level: string;
  nodeId: string;
  destination?: NodeJS.WritableStream;
}) {
  return pino(
    {
      level: options.level,
      base: { node: options.nodeId },
      redact: { paths: REDACT_PATHS, censor: '***' },
      timestamp: pino.stdTimeFunctions.isoTime,
    },
    options.destination,
  );
}

/** A logger that drops everything, for library users and unit tests that pass none. */
export const silentLogger: Logger = pino({ level: 'silent' });
