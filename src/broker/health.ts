import { Admin, Connection, describeQuorumV2 } from '@platformatic/kafka';
import { withTimeout } from '../errors.js';
import { baseOptions, type BrokerClient } from './client.js';

/** KRaft's metadata log: the controllers are its quorum. */
const METADATA_LOG = { topicName: '__cluster_metadata', partitions: [{ partitionIndex: 0 }] };

/**
 * A long-lived admin client used to answer "is Kafka reachable?" with a real metadata request,
 * for readiness. The client connects on first use and reconnects by itself after an outage.
 */
export class KafkaProbe {
  private readonly admin: Admin;

  constructor(private readonly kafka: BrokerClient) {
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

  /**
   * Every listener of the KRaft controllers (DescribeQuorum v2, Kafka 3.9 and later, lists the
   * quorum's nodes with their listeners), asked of the first bootstrap broker that answers, on a
   * connection of its own: the admin client has no call for it. The metadata lists brokers only
   * and no client is configured with a controller's address, so this is the one way to learn them.
   * An error when no broker answered or the answer names no listener (an ACL, an older Kafka).
   */
  async controllers(timeoutMs = 2000): Promise<{ host: string; port: number }[]> {
    const asked = this.describeQuorum();
    asked.catch(() => undefined); // abandoned when the deadline wins; its connection still closes
    return withTimeout(asked, timeoutMs, 'kafka quorum');
  }

  private async describeQuorum(): Promise<{ host: string; port: number }[]> {
    let failure: unknown = new Error('no bootstrap broker');
    for (const broker of this.kafka.brokers) {
      const cut = broker.lastIndexOf(':');
      const connection = new Connection(this.kafka.clientId, {
        connectTimeout: this.kafka.connectionTimeoutMs,
        requestTimeout: this.kafka.requestTimeoutMs,
      });
      try {
        await connection.connect(
          broker.slice(0, cut).replace(/^\[(.*)\]$/, '$1'),
          Number(broker.slice(cut + 1)),
        );
        const answer = await describeQuorumV2.api.async(connection, [METADATA_LOG]);
        const listeners = answer.nodes.flatMap((n) =>
          n.listeners.map((l) => ({ host: l.host, port: l.port })),
        );
        if (listeners.length > 0) return listeners;
        failure = new Error('kafka lists no controller listener');
      } catch (err) {
        failure = err;
      } finally {
        await connection.close().catch(() => undefined);
      }
    }
    throw failure;
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
