import type { Admin } from 'kafkajs';
import { withTimeout } from '../errors.js';
import type { BrokerClient } from './client.js';

/**
 * A long-lived admin connection used to answer "is Kafka reachable?" with a real metadata
 * request (describeCluster), for readiness.
 */
export class KafkaProbe {
  private admin?: Admin;
  private connecting?: Promise<Admin>;
  private connectingAdmin?: Admin;
  private closed = false;

  constructor(private readonly kafka: BrokerClient) {}

  /** Resolves when the cluster answered with at least one broker. */
  async check(timeoutMs = 2000): Promise<void> {
    const admin = this.admin ?? (await withTimeout(this.connect(), timeoutMs, 'kafka admin connect'));
    const cluster = await withTimeout(admin.describeCluster(), timeoutMs, 'kafka describeCluster');
    if (cluster.brokers.length === 0) throw new Error('kafka reports no brokers');
  }

  /**
   * One connect at a time, kept until it settles even when a check gave up waiting: while Kafka
   * is down every readiness probe would otherwise start another admin client, and those that
   * connected later would stay open, unreferenced, for the life of the process.
   */
  private connect(): Promise<Admin> {
    this.connecting ??= (async () => {
      const admin = (this.connectingAdmin = this.kafka.admin());
      try {
        await admin.connect();
      } catch (err) {
        await admin.disconnect().catch(() => undefined);
        throw err;
      } finally {
        this.connecting = undefined;
        this.connectingAdmin = undefined;
      }
      if (this.closed) {
        await admin.disconnect().catch(() => undefined);
        throw new Error('kafka probe closed');
      }
      this.admin = admin;
      return admin;
    })();
    return this.connecting;
  }

  async close(): Promise<void> {
    this.closed = true;
    const pending = this.connecting;
    const admin = this.admin;
    this.admin = undefined;
    await admin?.disconnect();
    // Disconnecting ends a connect in progress (Kafka down) instead of waiting out its retries.
    await this.connectingAdmin?.disconnect().catch(() => undefined);
    await pending?.catch(() => undefined);
  }
}
