import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, rmSync } from 'node:fs';
import { createEtcdClient } from '../../src/coordination/etcd.js';
import { REPO_ROOT } from './env.js';
import { waitFor } from './execution.js';

/**
 * A single-member etcd of a test's own, with an empty data directory (a fresh data set: its own
 * cluster id, its revisions from 1), serving clients on `clientPort` and peers on the port after.
 */
export class EtcdServer {
  private constructor(
    readonly url: string,
    private readonly process: ChildProcess,
    private readonly dir: string,
  ) {}

  static async start(name: string, clientPort: number): Promise<EtcdServer> {
    const dir = mkdtempSync(`${REPO_ROOT}.helios/etcd-${name}-`);
    const url = `http://127.0.0.1:${clientPort}`;
    const peer = `http://127.0.0.1:${clientPort + 1}`;
    const child = spawn(
      'etcd',
      [
        ...['--name', name, '--data-dir', dir],
        ...['--listen-client-urls', url, '--advertise-client-urls', url],
        ...['--listen-peer-urls', peer, '--initial-advertise-peer-urls', peer],
        ...['--initial-cluster', `${name}=${peer}`, '--log-level', 'error', '--logger', 'zap'],
      ],
      { stdio: 'ignore' },
    );
    const server = new EtcdServer(url, child, dir);
    const client = createEtcdClient([url]);
    try {
      await waitFor(
        `the ${name} etcd to answer`,
        () =>
          client
            .get('/ping')
            .string()
            .then(
              () => true,
              () => false,
            ),
        20_000,
        200,
      );
    } catch (err) {
      await server.stop();
      throw err;
    } finally {
      client.close();
    }
    return server;
  }

  async stop(): Promise<void> {
    if (this.process.exitCode === null && this.process.signalCode === null) {
      this.process.kill('SIGTERM');
      await once(this.process, 'exit');
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}
