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
    await this.brokers(timeoutMs);
  }

  /**
   * Every broker the cluster's metadata lists (an IPv6 host as Kafka sends it, without brackets);
   * an answer with none is an error.
   */
  async brokers(timeoutMs = 2000): Promise<{ host: string; port: number }[]> {
    const { brokers } = await this.metadata(timeoutMs);
    if (brokers.size === 0) throw new Error('kafka reports no brokers');
    return [...brokers.values()].map((b) => ({ host: b.host, port: b.port }));
  }

  private metadata(timeoutMs: number) {
    const asked = this.admin.metadata({ topics: [], forceUpdate: true });
    asked.catch(() => undefined); // abandoned when the deadline wins
    return withTimeout(asked, timeoutMs, 'kafka metadata');
  }

  async close(): Promise<void> {
    await this.admin.close();
  }
}
