import type { Admin } from 'kafkajs';
import { withTimeout } from '../errors.js';
import type { BrokerClient } from './client.js';

/**
 * A long-lived admin connection used to answer "is Kafka reachable?" with a real metadata
 * request (describeCluster), for readiness.
 */
export class KafkaProbe {
  private admin?: Admin;
  private connecting?: Promise<void>;

  constructor(private readonly kafka: BrokerClient) {}

  /** Resolves when the cluster answered with at least one broker. */
  async check(timeoutMs = 2000): Promise<void> {
    if (!this.admin) {
      const admin = this.kafka.admin();
      this.connecting ??= admin.connect().then(() => {
        this.admin = admin;
      });
      try {
        await withTimeout(this.connecting, timeoutMs, 'kafka admin connect');
      } finally {
        this.connecting = undefined;
      }
    }
    const cluster = await withTimeout(this.admin!.describeCluster(), timeoutMs, 'kafka describeCluster');
    if (cluster.brokers.length === 0) throw new Error('kafka reports no brokers');
  }

  async close(): Promise<void> {
    const admin = this.admin;
    this.admin = undefined;
    await admin?.disconnect();
  }
}
