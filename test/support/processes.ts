import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { createInterface } from 'node:readline';
import { REPO_ROOT, serverEnv } from './env.js';

/** One JSON log line of a node (pino). */
export type LogLine = Record<string, unknown> & { msg?: string; level?: number };

/** When a node logged `line`, ms since the epoch (pino writes `time` as an ISO string: stdTimeFunctions.isoTime). */
export function loggedAt(line: LogLine): number {
  return typeof line.time === 'string' ? Date.parse(line.time) : Number(line.time ?? NaN);
}

/** A child process whose JSON log lines are collected and can be waited for. */
export class ManagedProcess {
  readonly logs: LogLine[] = [];
  readonly stderr: string[] = [];
  /** Wall-clock ms when the process exited, once it has. */
  exitedAt?: number;
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  private readonly waiters = new Set<() => void>();

  constructor(
    readonly name: string,
    readonly child: ChildProcess,
  ) {
    this.exited = once(child, 'exit').then(([code, signal]) => {
      this.exitedAt = Date.now();
      this.poke();
      return { code: code as number | null, signal: signal as NodeJS.Signals | null };
    });
    createInterface({ input: child.stdout! }).on('line', (line) => {
      try {
        this.logs.push(JSON.parse(line) as LogLine);
      } catch {
        this.logs.push({ msg: line });
      }
      this.poke();
    });
    createInterface({ input: child.stderr! }).on('line', (line) => {
      this.stderr.push(line);
      this.poke();
    });
  }

  get pid(): number {
    return this.child.pid!;
  }

  get running(): boolean {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  private poke() {
    for (const wake of this.waiters) wake();
  }

  /** Resolves with the first log line matching `predicate` (already logged or future). */
  async waitForLog(predicate: (line: LogLine) => boolean, timeoutMs = 20_000): Promise<LogLine> {
    const deadline = Date.now() + timeoutMs;
    let seen = 0;
    for (;;) {
      for (; seen < this.logs.length; seen++) if (predicate(this.logs[seen]!)) return this.logs[seen]!;
      if (!this.running)
        throw new Error(
          `${this.name} exited while waiting for a log line; stderr: ${this.stderr.join('\n')}`,
        );
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`${this.name}: timed out waiting for a log line`);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(done, Math.min(left, 200));
        function done() {
          clearTimeout(timer);
          resolve();
        }
        this.waiters.add(done);
      }).finally(() => undefined);
      this.waiters.clear();
    }
  }

  hasLog(predicate: (line: LogLine) => boolean): boolean {
    return this.logs.some(predicate);
  }

  /**
   * Resolves when a hooked node (test/fixtures/hooked-node.ts, spawned with spawnFixture) reports
   * over IPC that its leader `step` passed its checks and is held.
   */
  async heldAt(step: 'write' | 'publish'): Promise<void> {
    for (;;) {
      const [message] = (await once(this.child, 'message')) as [{ pending?: string }];
      if (message.pending === step) return;
    }
  }

  signal(sig: NodeJS.Signals): void {
    if (this.running) this.child.kill(sig);
  }

  /** SIGTERM, then SIGKILL after `graceMs`; resolves when the process has exited. */
  async stop(graceMs = 8000): Promise<void> {
    if (!this.running) return;
    this.child.kill('SIGCONT');
    this.child.kill('SIGTERM');
    const timer = setTimeout(() => this.child.kill('SIGKILL'), graceMs);
    await this.exited;
    clearTimeout(timer);
  }
}

/** Environment of a node pointed at the real servers, isolated by database, etcd prefix and topics. */
export interface NodeEnv {
  readonly databaseUrl: string;
  readonly etcdPrefix: string;
  readonly topic: string;
  readonly extra?: Record<string, string>;
}

export function nodeEnvironment(nodeId: string, env: NodeEnv): Record<string, string> {
  const servers = serverEnv();
  return {
    PATH: process.env.PATH ?? '',
    HOME: process.env.HOME ?? '/tmp',
    HELIOS_NODE_ID: nodeId,
    HELIOS_DATABASE_URL: env.databaseUrl,
    HELIOS_ETCD_ENDPOINTS: servers.etcdEndpoints,
    HELIOS_KAFKA_BROKERS: servers.kafkaBrokers,
    HELIOS_ETCD_PREFIX: env.etcdPrefix,
    HELIOS_KAFKA_TOPIC: env.topic,
    HELIOS_KAFKA_DLQ_TOPIC: `${env.topic}.dlq`,
    HELIOS_KAFKA_GROUP: `${env.topic}.workers`,
    HELIOS_KAFKA_PARTITIONS: '2',
    HELIOS_HTTP_PORT: '0',
    HELIOS_LOG_LEVEL: 'info',
    HELIOS_SHUTDOWN_TIMEOUT_MS: '3000',
    ...env.extra,
  };
}

/** Starts the built CLI (`dist/main.js node`) as a child process. */
export function spawnNode(nodeId: string, env: NodeEnv): ManagedProcess {
  const child = spawn(process.execPath, [`${REPO_ROOT}dist/main.js`, 'node'], {
    env: nodeEnvironment(nodeId, env),
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  return new ManagedProcess(nodeId, child);
}

/** Starts a TypeScript fixture (through tsx) with an IPC channel. */
export function spawnFixture(name: string, script: string, env: Record<string, string>): ManagedProcess {
  const child = spawn(process.execPath, ['--import', 'tsx', `${REPO_ROOT}${script}`], {
    env: { ...env },
    stdio: ['ignore', 'pipe', 'pipe', 'ipc'],
    cwd: REPO_ROOT,
  });
  return new ManagedProcess(name, child);
}

/** Stops every process, even if some fail to stop. */
export async function stopAll(processes: ManagedProcess[]): Promise<void> {
  await Promise.allSettled(processes.map((p) => p.stop()));
}

/**
 * Runs the built CLI (`dist/main.js ARGS`) with exactly `env` (add PATH yourself) and resolves
 * when it exits, with its exit code and output (`output` is stdout and stderr as they came).
 */
export async function runCli(
  args: string[],
  env: Record<string, string | undefined>,
): Promise<{ code: number | null; stdout: string; stderr: string; output: string }> {
  const child = spawn(process.execPath, [`${REPO_ROOT}dist/main.js`, ...args], {
    env,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stdout = '';
  let stderr = '';
  let output = '';
  child.stdout!.on('data', (chunk: Buffer) => ((stdout += chunk.toString()), (output += chunk.toString())));
  child.stderr!.on('data', (chunk: Buffer) => ((stderr += chunk.toString()), (output += chunk.toString())));
  const [code] = (await once(child, 'exit')) as [number | null];
  return { code, stdout, stderr, output };
}

/** Runs `scripts/infra.sh ARGS` and resolves when it exits 0. */
export async function infra(...args: string[]): Promise<void> {
  const child = spawn('bash', [serverEnv().infraScript, ...args], { stdio: ['ignore', 'ignore', 'pipe'] });
  let err = '';
  child.stderr!.on('data', (chunk: Buffer) => (err += chunk.toString()));
  const [code] = (await once(child, 'exit')) as [number | null];
  if (code !== 0) throw new Error(`infra.sh ${args.join(' ')} failed (${code}): ${err}`);
}
