import { Admin } from '@platformatic/kafka';
import { withTimeout } from '../errors.js';
import { baseOptions, type BrokerClient } from './client.js';

/**
 * A long-lived admin client used to answer "is Kafka reachable?" with a real metadata request,
 * for readiness. The client connects on first use and reconnects by itself after an outage.
 */
export class KafkaProbe {
  private readonly admin: Admin;

  constructor(kafka: BrokerClient) {
    this.admin = new Admin(baseOptions(kafka));
  }

  /** Resolves when the cluster answered with at least one broker. */
  async check(timeoutMs = 2000): Promise<void> {
    const asked = this.admin.metadata({ topics: [], forceUpdate: true });
    asked.catch(() => undefined); // abandoned when the deadline wins
    const cluster = await withTimeout(asked, timeoutMs, 'kafka metadata');
    if (cluster.brokers.size === 0) throw new Error('kafka reports no brokers');
  }

  async close(): Promise<void> {
    await this.admin.close();
  }
}
