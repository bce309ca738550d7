import { createKafka, RunConsumer, type ConsumedMessage } from '../../src/broker/index.js';
import { silentLogger } from '../../src/observability/logger.js';
import { serverEnv, uniqueId } from './env.js';

/** Reads every message of a topic (from the beginning) into memory, with its own group. */
export class TopicRecorder {
  readonly messages: ConsumedMessage[] = [];
  private readonly consumer: RunConsumer;

  constructor(topic: string) {
    const kafka = createKafka({
      brokers: serverEnv().kafkaBrokers.split(','),
      clientId: `recorder-${uniqueId()}`,
      logger: silentLogger,
    });
    this.consumer = new RunConsumer({
      kafka,
      logger: silentLogger,
      groupId: `recorder-${uniqueId()}`,
      topic,
    });
  }

  start(): Promise<void> {
    return this.consumer.start(async (message) => {
      this.messages.push(message);
    });
  }

  /** Payloads parsed as JSON. */
  payloads<T>(): T[] {
    return this.messages.map((m) => JSON.parse(m.value ?? 'null') as T);
  }

  stop(): Promise<void> {
    return this.consumer.stop();
  }
}
