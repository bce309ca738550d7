import { createServer, connect, type Server, type Socket } from 'node:net';
import type { AddressInfo } from 'node:net';

/**
 * A TCP proxy on 127.0.0.1 that a test can cut: while cut, bytes in both directions are held
 * back (a partition, not a reset: the peers see silence, as when a network drops packets) and new
 * connections are accepted but not forwarded. `heal()` closes the held connections so clients
 * reconnect cleanly.
 */
export class TcpProxy {
  private readonly server: Server;
  private readonly pairs = new Set<[Socket, Socket]>();
  private cutOff = false;

  constructor(
    private readonly targetHost: string,
    private readonly targetPort: number,
  ) {
    this.server = createServer((client) => this.accept(client));
  }

  private accept(client: Socket): void {
    const upstream = connect(this.targetPort, this.targetHost);
    const pair: [Socket, Socket] = [client, upstream];
    this.pairs.add(pair);
    const forward = (from: Socket, to: Socket) =>
      from.on('data', (chunk: Buffer) => {
        if (!this.cutOff) to.write(chunk);
      });
    forward(client, upstream);
    forward(upstream, client);
    const close = () => {
      this.pairs.delete(pair);
      client.destroy();
      upstream.destroy();
    };
    client.on('error', close).on('close', close);
    upstream.on('error', close).on('close', close);
  }

  async listen(): Promise<number> {
    await new Promise<void>((resolve) => this.server.listen(0, '127.0.0.1', resolve));
    return (this.server.address() as AddressInfo).port;
  }

  get port(): number {
    return (this.server.address() as AddressInfo).port;
  }

  /** Drops all traffic from now on (connections stay open, silent). */
  cut(): void {
    this.cutOff = true;
  }

  /** Restores traffic; connections opened or stalled during the cut are closed so clients redial. */
  heal(): void {
    this.cutOff = false;
    for (const [a, b] of this.pairs) {
      a.destroy();
      b.destroy();
    }
    this.pairs.clear();
  }

  async close(): Promise<void> {
    this.heal();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}
