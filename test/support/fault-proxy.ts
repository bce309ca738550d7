import { createServer, connect, type Server, type Socket } from 'node:net';
import type { AddressInfo } from 'node:net';

/**
 * A TCP proxy in front of PostgreSQL with the faults TcpProxy (tcp-proxy.ts) cannot make.
 *  - `cut('drop')`: bytes both ways are discarded, connections stay open (TcpProxy's cut);
 *    `cut('hold')`: bytes both ways, and a side's close, are held back and delivered in order by
 *    `heal()`, as TCP retransmissions deliver them once a real partition heals.
 *  - `heal({ closeExisting })`: traffic flows again; with closeExisting (TcpProxy's heal) every
 *    connection open now is closed.
 *  - `silenceExisting()`: the connections open now go silent for good (bytes dropped both ways,
 *    never closed) while new connections are forwarded normally: a stateful firewall or NAT that
 *    lost its state, or a database that moved to another host behind the same address.
 *  - `newConnectionDelayMs`: each new connection is forwarded only after this long (a database
 *    or a connection pooler slow to take new sessions); existing ones are not slowed. Such a
 *    connection's half-close (a CancelRequest's) reaches the server once it is connected, and the
 *    connection closes when the server closes it, not at once.
 * Each connection is labelled with the application_name of its startup packet.
 */
interface Pair {
  readonly client: Socket;
  upstream?: Socket;
  applicationName?: string;
  silenced: boolean;
  /** Bytes held for each direction (hold mode, or before the delayed upstream is connected). */
  readonly toUp: Buffer[];
  readonly toClient: Buffer[];
  clientClosed: boolean;
  /** The client half-closed a delayed connection (see newConnectionDelayMs). */
  clientEnded: boolean;
  upClosed: boolean;
  startup: Buffer;
}

export class FaultProxy {
  private readonly server: Server;
  private readonly pairs = new Set<Pair>();
  private mode: 'forward' | 'drop' | 'hold' = 'forward';
  newConnectionDelayMs = 0;
  /**
   * When set, each new connection is answered at once with this FATAL error, as PostgreSQL
   * answers a connection over its limit (SQLSTATE 53300), and closed; existing ones go on.
   */
  refuseNew?: { code: string; message: string };
  /** Called with each connection's application_name once its startup packet has been seen. */
  onStartup?: (applicationName: string) => void;
  /** application_names of every connection accepted, in order. */
  readonly seen: string[] = [];

  constructor(
    private readonly targetHost: string,
    private readonly targetPort: number,
  ) {
    this.server = createServer((client) => this.accept(client));
  }

  /** `count` proxies in front of the server of `databaseUrl`, listening. */
  static async inFrontOf(databaseUrl: string, count: number): Promise<FaultProxy[]> {
    const url = new URL(databaseUrl);
    const proxies: FaultProxy[] = [];
    for (let i = 0; i < count; i++) {
      const proxy = new FaultProxy(url.hostname, Number(url.port || 5432));
      await proxy.listen();
      proxies.push(proxy);
    }
    return proxies;
  }

  async listen(): Promise<number> {
    await new Promise<void>((resolve) => this.server.listen(0, '127.0.0.1', resolve));
    return this.port;
  }

  get port(): number {
    return (this.server.address() as AddressInfo).port;
  }

  /** The URL of `databaseUrl` pointed at this proxy. */
  urlFor(databaseUrl: string): string {
    const url = new URL(databaseUrl);
    url.hostname = '127.0.0.1';
    url.port = String(this.port);
    return url.toString();
  }

  private accept(client: Socket): void {
    if (this.refuseNew) {
      const { code, message } = this.refuseNew;
      const fields = Buffer.concat([
        ...[
          ['S', 'FATAL'],
          ['V', 'FATAL'],
          ['C', code],
          ['M', message],
        ].map(([k, v]) => Buffer.from(`${k}${v}\u0000`, 'utf8')),
        Buffer.from([0]),
      ]);
      const header = Buffer.alloc(5);
      header.write('E', 0);
      header.writeInt32BE(fields.length + 4, 1);
      // After the startup packet, as the server would.
      client.once('data', () => client.end(Buffer.concat([header, fields])));
      client.on('error', () => undefined);
      return;
    }
    const pair: Pair = {
      client,
      silenced: false,
      toUp: [],
      toClient: [],
      clientClosed: false,
      clientEnded: false,
      upClosed: false,
      startup: Buffer.alloc(0),
    };
    this.pairs.add(pair);
    client.on('data', (chunk: Buffer) => {
      this.sniff(pair, chunk);
      this.send(pair, 'up', chunk);
    });
    const clientGone = () => {
      if (pair.clientClosed) return;
      pair.clientClosed = true;
      // A silenced connection tells the other side nothing; held ones are told by heal().
      if (pair.silenced || this.mode === 'hold' || !pair.upstream) return; // delivered by heal() / once connected
      this.finish(pair);
    };
    client.on('error', clientGone).on('close', clientGone);
    const open = () => {
      if (pair.clientClosed && this.mode !== 'hold' && pair.toUp.length === 0) {
        this.finish(pair);
        return;
      }
      const upstream = connect(this.targetPort, this.targetHost);
      pair.upstream = upstream;
      upstream.on('data', (chunk: Buffer) => this.send(pair, 'client', chunk));
      const upGone = () => {
        if (pair.upClosed) return;
        pair.upClosed = true;
        if (pair.silenced || this.mode === 'hold') return;
        this.finish(pair);
      };
      upstream.on('error', upGone).on('close', upGone);
      if (this.mode !== 'hold') this.flush(pair);
      if (pair.clientEnded && !pair.silenced) upstream.end();
    };
    if (this.newConnectionDelayMs > 0) {
      // Node would end the client side at once on the client's half-close: a server not yet
      // reached cannot have answered it.
      client.allowHalfOpen = true;
      client.on('end', () => {
        pair.clientEnded = true;
        if (pair.upstream && !pair.silenced && this.mode === 'forward') pair.upstream.end();
      });
      setTimeout(open, this.newConnectionDelayMs);
    } else open();
  }

  /** Reads application_name from the startup packet (protocol 3.0, no SSL request). */
  private sniff(pair: Pair, chunk: Buffer): void {
    if (pair.applicationName !== undefined) return;
    pair.startup = Buffer.concat([pair.startup, chunk]);
    if (pair.startup.length < 8) return;
    const length = pair.startup.readInt32BE(0);
    if (pair.startup.length < length) return;
    const fields = pair.startup.subarray(8, length).toString('utf8').split('\u0000');
    const at = fields.indexOf('application_name');
    pair.applicationName = at >= 0 ? (fields[at + 1] ?? '') : '';
    this.seen.push(pair.applicationName);
    this.onStartup?.(pair.applicationName);
  }

  private send(pair: Pair, dir: 'up' | 'client', chunk: Buffer): void {
    if (pair.silenced || this.mode === 'drop') return;
    const held = dir === 'up' ? pair.toUp : pair.toClient;
    if (this.mode === 'hold' || (dir === 'up' && !pair.upstream) || held.length > 0) {
      held.push(chunk);
      return;
    }
    const to = dir === 'up' ? pair.upstream! : pair.client;
    if (!to.destroyed) to.write(chunk);
  }

  private flush(pair: Pair): void {
    if (pair.upstream && !pair.upstream.destroyed)
      for (const chunk of pair.toUp.splice(0)) pair.upstream.write(chunk);
    if (!pair.client.destroyed) for (const chunk of pair.toClient.splice(0)) pair.client.write(chunk);
    if (pair.clientClosed || pair.upClosed) this.finish(pair);
  }

  /** One side went away: the other is ended after what it was sent (end, not destroy). */
  private finish(pair: Pair): void {
    this.pairs.delete(pair);
    pair.client.end();
    pair.upstream?.end();
    setTimeout(() => {
      pair.client.destroy();
      pair.upstream?.destroy();
    }, 200).unref();
  }

  cut(mode: 'drop' | 'hold'): void {
    this.mode = mode;
  }

  heal(options: { closeExisting?: boolean } = {}): void {
    this.mode = 'forward';
    for (const pair of [...this.pairs]) {
      if (options.closeExisting) {
        this.pairs.delete(pair);
        pair.client.destroy();
        pair.upstream?.destroy();
      } else if (!pair.silenced) {
        this.flush(pair);
      }
    }
  }

  /** Every connection open now goes silent for good; new ones are forwarded. Returns their names. */
  silenceExisting(filter: (applicationName: string) => boolean = () => true): string[] {
    const names: string[] = [];
    for (const pair of this.pairs) {
      if (!filter(pair.applicationName ?? '')) continue;
      pair.silenced = true;
      pair.toUp.length = 0;
      pair.toClient.length = 0;
      names.push(pair.applicationName ?? '?');
    }
    return names;
  }

  async close(): Promise<void> {
    this.heal({ closeExisting: true });
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}
