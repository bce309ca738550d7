import type { Database } from '../store/db.js';
import type { Logger } from '../observability/logger.js';
import type { Metrics } from '../observability/metrics.js';
import type { Notifications } from '../store/notifications.js';
import { isBrokerRefusal } from '../broker/index.js';
import { toError } from '../errors.js';
import {
  markPublished,
  markPublishFailed,
  msUntilNextOutboxRow,
  selectDueOutbox,
  type OutboxRow,
} from '../store/outbox.js';
import { loopBackoffMs } from '../loop-backoff.js';

/** What the relay needs from the broker (structurally satisfied by broker/RunPublisher). */
export interface MessagePublisher {
  publish(topic: string, messages: { key: string; value: string }[]): Promise<unknown>;
}

export interface OutboxRelayOptions {
  readonly pool: Database;
  readonly publisher: MessagePublisher;
  readonly notifications: Notifications;
  /** Ends the relay (the leader's epoch signal). */
  readonly signal: AbortSignal;
  /** Rows per publish; default 1000. */
  readonly batchSize?: number;
  readonly logger: Logger;
  readonly metrics: Metrics;
  /** Fault injection for tests: awaited after rows were read and before they are published. */
  readonly beforePublish?: () => Promise<void>;
}

const MAX_SLEEP_MS = 1000;
/** Rows of a failed batch that fail one by one, none going out, before the relay calls it an outage. */
const ISOLATION_GIVES_UP_AFTER = 2;

/**
 * Publishes due outbox rows to Kafka, then marks them published. A crash between the two
 * re-publishes the batch: consumers dedupe by claiming the run in PostgreSQL. Rows are never
 * skipped: a failed batch stays pending and is retried with backoff; a row that fails on its own
 * while the rest of its batch publishes is put off with a growing back-off (its run still
 * executes: the workers' polling fallback claims it once overdue).
 */
export class OutboxRelay {
  constructor(private readonly options: OutboxRelayOptions) {}

  /** Runs until the signal aborts; never rejects. */
  async run(): Promise<void> {
    const { signal, notifications, logger, metrics, pool } = this.options;
    const batchSize = this.options.batchSize ?? 1000;
    let failures = 0;
    while (!signal.aborted) {
      let rows: OutboxRow[] = [];
      // Read first: a row committed while this pass reads the outbox ends the sleep below.
      const seen = notifications.seen('helios_outbox');
      try {
        rows = await selectDueOutbox(pool, batchSize);
        if (rows.length > 0) {
          await this.options.beforePublish?.();
          await this.publish(rows);
          await markPublished(
            pool,
            rows.map((r) => r.id),
          );
          metrics.outboxPublished.inc(rows.length);
          failures = 0;
          if (rows.length === batchSize) continue;
        }
        const untilDue = await msUntilNextOutboxRow(pool);
        const sleepMs = untilDue === null ? MAX_SLEEP_MS : Math.min(MAX_SLEEP_MS, Math.max(untilDue, 5));
        await notifications.wait('helios_outbox', sleepMs, signal, seen);
      } catch (err) {
        if (signal.aborted) return;
        metrics.outboxPublishFailures.inc();
        const error = toError(err);
        // One row the broker refuses (too large, say) must not hold back every row behind it.
        // Only a refusal is isolated: in an outage each single publish would wait for its timeout.
        if (isBrokerRefusal(error) && (await this.isolate(rows).catch(() => false))) {
          failures = 0;
          continue;
        }
        failures += 1;
        logger.warn({ err: error, rows: rows.length, failures }, 'outbox publish failed; retrying');
        if (rows.length > 0) {
          await markPublishFailed(
            pool,
            rows.map((r) => r.id),
            error.message,
          ).catch(() => undefined);
        }
        await notifications.wait('helios_outbox', loopBackoffMs(failures, 5000), signal);
      }
    }
  }

  /**
   * After a failed batch: publishes its rows one at a time, marks those that went out, and puts
   * off those that failed on their own. Returns false, having changed nothing, when the first rows
   * all fail too: then the broker is away, not a row, and the whole batch waits for it.
   */
  private async isolate(rows: OutboxRow[]): Promise<boolean> {
    const { pool, logger, metrics } = this.options;
    const published: string[] = [];
    const refused: { row: OutboxRow; error: Error }[] = [];
    let unreachable = 0;
    for (const row of rows) {
      // Rows the broker refuses, however many lead the batch, are theirs; only failures that are
      // not refusals say the broker is away.
      if (published.length === 0 && unreachable >= ISOLATION_GIVES_UP_AFTER) return false;
      try {
        await this.publish([row]);
        published.push(row.id);
      } catch (err) {
        if (isBrokerRefusal(err)) refused.push({ row, error: toError(err) });
        else unreachable += 1;
      }
    }
    // Nothing refused: whatever failed, failed for want of the broker; the batch waits for it.
    if (refused.length === 0) return false;
    if (published.length > 0) await markPublished(pool, published);
    metrics.outboxPublished.inc(published.length);
    // Counted at each try: a put-off row's publish_after moves on, so the outbox age gauge never
    // shows how long it has waited; this counter is what HeliosOutboxStalled reads for it.
    metrics.outboxRowsRefused.inc(refused.length);
    for (const { row, error } of refused) {
      logger.error(
        { err: error, outboxId: row.id, topic: row.topic, key: row.key },
        'outbox row refused by the broker; putting it off',
      );
      await markPublishFailed(pool, [row.id], error.message, true);
    }
    return true;
  }

  private async publish(rows: OutboxRow[]): Promise<void> {
    const byTopic = new Map<string, { key: string; value: string }[]>();
    for (const row of rows) {
      let list = byTopic.get(row.topic);
      if (!list) byTopic.set(row.topic, (list = []));
      list.push({ key: row.key, value: JSON.stringify(row.payload) });
    }
    for (const [topic, messages] of byTopic) await this.options.publisher.publish(topic, messages);
  }
}
