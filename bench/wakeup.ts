/**
 * What this machine charges for one request and its answer between two processes over loopback
 * TCP, without HTTP: the floor under every call a worker (or a peer's handler) makes to a target.
 * A client process sends `rounds` messages of 300 bytes on `window` connections at a time to an
 * echo server in another process, which answers each with 100 bytes; both report their CPU
 * (user + system, `process.cpuUsage()`) per round trip. For scale, the CPU of a system call that
 * wakes nobody (a 1-byte write to /dev/null) is printed first.
 *
 *   npx tsx bench/wakeup.ts [--rounds 20000] [--windows 1,64] [--repeat 3]
 *
 * On a machine where a send that wakes another process costs tens of times a plain system call
 * (a virtual machine's cross-CPU wake-ups), a herd's calls cost that on both sides, whoever makes
 * them: compare the executor's CPU per call (bench/http-cpu.ts) and the target's with this.
 */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { closeSync, openSync, writeSync } from 'node:fs';
import { connect, createServer, type Socket } from 'node:net';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { machine, median } from './lib/stats.js';

const REQUEST = Buffer.alloc(300, 'x');
const ANSWER = Buffer.alloc(100, 'y');
const WARMUP_ROUNDS = 2_000;

const cpuMicros = () => {
  const { user, system } = process.cpuUsage();
  return user + system;
};

/** The echo server (child process): answers every 300 bytes with 100; reports its CPU on request. */
async function echoServer(): Promise<void> {
  const server = createServer({ noDelay: true }, (socket) => {
    let pending = 0;
    socket.on('data', (chunk: Buffer) => {
      pending += chunk.length;
      while (pending >= REQUEST.length) {
        pending -= REQUEST.length;
        socket.write(ANSWER);
      }
    });
    socket.on('error', () => undefined);
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const address = server.address();
  if (address === null || typeof address === 'string') throw new Error('no port');
  process.on('message', (message) => {
    if (message === 'cpu') process.send!(cpuMicros());
    if (message === 'stop') server.close(() => process.exit(0));
  });
  process.send!(address.port);
}

/** `rounds` round trips, `window` connections each with one message in flight; resolves with the wall ms. */
async function roundTrips(port: number, rounds: number, window: number): Promise<number> {
  const sockets = await Promise.all(
    Array.from({ length: window }, async () => {
      const socket = connect({ port, host: '127.0.0.1', noDelay: true });
      await once(socket, 'connect');
      return socket;
    }),
  );
  const started = performance.now();
  let sent = 0;
  await Promise.all(
    sockets.map(
      (socket: Socket) =>
        new Promise<void>((resolve) => {
          let pending = 0;
          const next = () => {
            if (sent >= rounds) return resolve();
            sent += 1;
            socket.write(REQUEST);
          };
          socket.on('data', (chunk: Buffer) => {
            pending += chunk.length;
            while (pending >= ANSWER.length) {
              pending -= ANSWER.length;
              next();
            }
          });
          next();
        }),
    ),
  );
  const wallMs = performance.now() - started;
  for (const socket of sockets) socket.destroy();
  return wallMs;
}

/** CPU µs of a 1-byte write to /dev/null, a system call that wakes no other process. */
function plainSyscallMicros(calls = 200_000): number {
  const fd = openSync('/dev/null', 'w');
  const byte = Buffer.from('x');
  try {
    const before = cpuMicros();
    for (let i = 0; i < calls; i++) writeSync(fd, byte);
    return (cpuMicros() - before) / calls;
  } finally {
    closeSync(fd);
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      rounds: { type: 'string', default: '20000' },
      windows: { type: 'string', default: '1,64' },
      repeat: { type: 'string', default: '3' },
      echo: { type: 'boolean', default: false },
    },
  });
  if (values.echo) return echoServer();
  const rounds = Number(values.rounds);
  const windows = values.windows.split(',').map(Number);
  console.log(`loopback round trips between two processes, ${machine()}`);
  console.log(
    `a system call that wakes nobody (write of 1 byte to /dev/null): ${plainSyscallMicros().toFixed(2)} µs of CPU`,
  );
  for (const window of windows) {
    const client: number[] = [];
    const server: number[] = [];
    const wall: number[] = [];
    for (let r = 0; r < Number(values.repeat); r++) {
      const echo = fork(fileURLToPath(import.meta.url), ['--echo']);
      const [port] = (await once(echo, 'message')) as [number];
      const serverCpu = async () => {
        echo.send('cpu');
        return ((await once(echo, 'message')) as [number])[0];
      };
      try {
        await roundTrips(port, WARMUP_ROUNDS, window);
        const [serverBefore, clientBefore] = [await serverCpu(), cpuMicros()];
        const wallMs = await roundTrips(port, rounds, window);
        const clientMicros = cpuMicros() - clientBefore;
        const serverMicros = (await serverCpu()) - serverBefore;
        client.push(clientMicros / rounds);
        server.push(serverMicros / rounds);
        wall.push((wallMs * 1000) / rounds);
      } finally {
        echo.send('stop');
        await once(echo, 'exit');
      }
    }
    const runs = (xs: number[]) => xs.map((x) => x.toFixed(1)).join(', ');
    console.log(
      `window ${window}: per round trip, client ${median(client).toFixed(1)} µs of CPU (${runs(client)}), ` +
        `server ${median(server).toFixed(1)} µs (${runs(server)}), wall ${median(wall).toFixed(1)} µs (${runs(wall)})`,
    );
  }
}

await main();
