import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http';
import { connect, type AddressInfo, type Socket } from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, test } from 'node:test';
import { HttpExecutor, type HttpCall } from '../../src/execution/http-executor.js';
import { ClusterEndpoints } from '../../src/security/cluster-endpoints.js';
import { compileTargetPolicy } from '../../src/security/target-policy.js';

// The executor against a real HTTP server on loopback: what it sends, what it records, and how
// every way a call can end becomes a report (bounded memory for huge or endless bodies).

interface Seen {
  method: string;
  url: string;
  headers: IncomingMessage['headers'];
  body: string;
}

const seen: Seen[] = [];
let closedEarly = 0;
/** The connection of the last /medium or /huge request. */
let lastSocket: Socket | undefined;
const handlers: Record<string, (req: IncomingMessage, res: ServerResponse) => void> = {
  '/ok': (_req, res) => res.end('fine'),
  '/fail': (_req, res) => {
    res.statusCode = 503;
    res.end('busy');
  },
  '/medium': (req, res) => {
    lastSocket = req.socket;
    res.end('m'.repeat(10 * 1024));
  },
  '/huge': (req, res) => {
    lastSocket = req.socket;
    res.writeHead(200, { 'content-type': 'text/plain' });
    res.end('x'.repeat(5 * 1024 * 1024));
  },
  '/endless': (_req, res) => {
    res.writeHead(200, { 'content-type': 'text/plain' });
    const timer = setInterval(() => res.write('y'.repeat(16 * 1024)), 5);
    res.on('close', () => {
      clearInterval(timer);
      closedEarly += 1;
    });
  },
  '/never': () => undefined,
  // The status and part of the body, then the connection is reset.
  '/cut-200': (_req, res) => {
    res.writeHead(200, { 'content-length': '1000' });
    res.write('done, and then', () => setTimeout(() => res.socket?.resetAndDestroy(), 20));
  },
  '/early-hints-then-cut': (_req, res) => {
    res.writeEarlyHints({ link: '</style.css>; rel=preload; as=style' }, () =>
      setTimeout(() => res.socket?.resetAndDestroy(), 20),
    );
  },
  '/cut-503': (_req, res) => {
    res.writeHead(503, { 'content-length': '1000' });
    res.write('busy, and then', () => setTimeout(() => res.socket?.resetAndDestroy(), 20));
  },
  // The status and part of the body, the rest never.
  '/status-then-stall': (_req, res) => {
    res.writeHead(200, { 'content-length': '1000' });
    res.write('accepted, and then');
  },
  '/empty': (_req, res) => {
    res.statusCode = 204;
    res.end();
  },
};

const server = createServer((req, res) => {
  let body = '';
  req.setEncoding('utf8');
  req.on('data', (chunk: string) => (body += chunk));
  req.on('end', () => {
    seen.push({
      method: req.method!,
      url: req.url!,
      headers: req.headers,
      body,
    });
    (handlers[req.url!.split('?')[0]!] ?? handlers['/ok']!)(req, res);
  });
});
let base: string;
const executor = new HttpExecutor({ maxExcerptBytes: 100 });

before(async () => {
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});
after(async () => {
  await executor.close();
  server.closeAllConnections();
  server.close();
});

function call(path: string, target: Partial<HttpCall['target']> = {}, timeoutMs = 5000): HttpCall {
  return {
    id: '00000000-0000-4000-8000-00000000000a',
    jobId: '00000000-0000-4000-8000-00000000000b',
    attempt: 2,
    scheduledFor: new Date('2026-11-29T12:00:00.000Z'),
    target: { url: `${base}${path}`, ...target },
    timeoutMs,
  };
}

const never = new AbortController().signal;

test('a GET carries the identity headers and records status, duration and excerpt', async () => {
  const report = await executor.execute(call('/ok?a=1', { headers: { 'X-Custom': 'v' } }), never);
  assert.equal(report.outcome, 'succeeded');
  assert.equal(report.statusCode, 200);
  assert.equal(report.responseExcerpt, 'fine');
  assert.equal(report.error, null);
  assert.ok(report.durationMs !== null && report.durationMs >= 0);
  const request = seen.at(-1)!;
  assert.equal(request.method, 'GET');
  assert.equal(request.url, '/ok?a=1');
  assert.equal(request.headers['x-custom'], 'v');
  assert.equal(request.headers['idempotency-key'], '00000000-0000-4000-8000-00000000000a');
  assert.equal(request.headers['x-helios-run-id'], '00000000-0000-4000-8000-00000000000a');
  assert.equal(request.headers['x-helios-job-id'], '00000000-0000-4000-8000-00000000000b');
  assert.equal(request.headers['x-helios-scheduled-for'], '2026-11-29T12:00:00.000Z');
  assert.equal(request.headers['x-helios-attempt'], '2');
});

test('a body is sent as JSON with POST by default, and a job cannot forge the identity headers', async () => {
  const report = await executor.execute(
    call('/ok', { body: { hello: 'wörld' }, headers: { 'Idempotency-Key': 'forged' } }),
    never,
  );
  assert.equal(report.outcome, 'succeeded');
  const request = seen.at(-1)!;
  assert.equal(request.method, 'POST');
  assert.equal(request.headers['content-type'], 'application/json');
  assert.deepEqual(JSON.parse(request.body), { hello: 'wörld' });
  assert.equal(request.headers['idempotency-key'], '00000000-0000-4000-8000-00000000000a');
});

test('a non-2xx status is a failed attempt with the status and the excerpt', async () => {
  const report = await executor.execute(call('/fail', { method: 'put' }), never);
  assert.equal(seen.at(-1)!.method, 'PUT');
  assert.equal(report.outcome, 'failed');
  assert.equal(report.statusCode, 503);
  assert.equal(report.error, 'HTTP 503');
  assert.equal(report.responseExcerpt, 'busy');
});

test('an empty response has no excerpt', async () => {
  const report = await executor.execute(call('/empty'), never);
  assert.equal(report.outcome, 'succeeded');
  assert.equal(report.statusCode, 204);
  assert.equal(report.responseExcerpt, null);
});

test('a body a little longer than the excerpt is read to its end, so the connection stays open', async () => {
  const report = await executor.execute(call('/medium'), never);
  assert.equal(report.outcome, 'succeeded');
  assert.equal(report.responseExcerpt, 'm'.repeat(100));
  await sleep(100);
  assert.equal(lastSocket!.destroyed, false, 'the connection is kept for the next call');
});

test('a huge body is cut at maxExcerptBytes and the connection is closed, not drained', async () => {
  const report = await executor.execute(call('/huge'), never);
  assert.equal(report.outcome, 'succeeded');
  assert.equal(report.responseExcerpt, 'x'.repeat(100));
  await sleep(100);
  assert.equal(lastSocket!.destroyed, true, 'the connection was closed, not drained');
});

test(
  'an endless body ends the call after the excerpt instead of buffering forever',
  { timeout: 10_000 },
  async () => {
    const before = closedEarly;
    const report = await executor.execute(call('/endless'), never);
    assert.equal(report.outcome, 'succeeded');
    assert.equal(report.responseExcerpt, 'y'.repeat(100));
    for (let i = 0; i < 50 && closedEarly === before; i++) await new Promise((r) => setTimeout(r, 20));
    assert.equal(closedEarly, before + 1, 'the server saw the connection closed');
  },
);

test('a target that never answers is aborted at timeoutMs', { timeout: 10_000 }, async () => {
  const started = performance.now();
  const report = await executor.execute(call('/never', {}, 300), never);
  const took = performance.now() - started;
  assert.equal(report.outcome, 'timeout');
  assert.equal(report.error, 'timed out after 300 ms');
  assert.ok(took >= 290 && took < 1500, `took ${took} ms`);
});

test('cancelling aborts the call with the cancel reason; an already-cancelled call does not start', async () => {
  const cancel = new AbortController();
  const pending = executor.execute(call('/never'), cancel.signal);
  setTimeout(() => cancel.abort(new Error('replaced by a newer run')), 100);
  const report = await pending;
  assert.equal(report.outcome, 'cancelled');
  assert.match(report.error ?? '', /replaced by a newer run/);

  const calls = seen.length;
  const cancelled = new AbortController();
  cancelled.abort(new Error('stopping'));
  const early = await executor.execute(call('/ok'), cancelled.signal);
  assert.equal(early.outcome, 'cancelled');
  assert.equal(seen.length, calls, 'no request was sent');
});

test(
  "the timeout and a cancel end a call whose connection is never made, not undici's 10 s connect timeout",
  { timeout: 30_000 },
  async (t) => {
    // A listener whose process never accepts (its event loop is blocked) and whose accept queue is
    // full drops every new SYN: a connect hangs, as to a firewalled or dead host.
    const stuck = spawn(
      process.execPath,
      [
        '-e',
        `require('node:net').createServer().listen({ port: 0, host: '127.0.0.1', backlog: 1 }, function () {
         process.stdout.write(String(this.address().port) + '\\n');
         setTimeout(() => Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0), 50);
       });`,
      ],
      { stdio: ['ignore', 'pipe', 'inherit'] },
    );
    t.after(() => stuck.kill('SIGKILL'));
    const [line] = (await once(stuck.stdout!, 'data')) as [Buffer];
    const port = Number(String(line).trim());
    await sleep(200);
    const fillers = Array.from({ length: 8 }, () => connect(port, '127.0.0.1').on('error', () => undefined));
    t.after(() => fillers.forEach((f) => f.destroy()));
    await sleep(300);
    const hung = (timeoutMs: number): HttpCall => ({
      ...call('/'),
      target: { url: `http://127.0.0.1:${port}/` },
      timeoutMs,
    });

    let started = performance.now();
    const timedOut = await executor.execute(hung(500), never);
    let took = performance.now() - started;
    assert.equal(timedOut.outcome, 'timeout', JSON.stringify(timedOut));
    assert.ok(took < 2000, `the 500 ms timeout ended the call after ${took.toFixed(0)} ms`);

    const cancel = new AbortController();
    started = performance.now();
    const pending = executor.execute(hung(60_000), cancel.signal);
    setTimeout(() => cancel.abort(new Error('claim lost')), 300);
    const cancelled = await pending;
    took = performance.now() - started;
    assert.equal(cancelled.outcome, 'cancelled', JSON.stringify(cancelled));
    assert.ok(took < 2000, `a cancel at 300 ms ended the call after ${took.toFixed(0)} ms`);
  },
);

test('a connection that fails while the body is read keeps the status the target answered with', async () => {
  const ok = await executor.execute(call('/cut-200'), never);
  assert.equal(ok.outcome, 'succeeded', JSON.stringify(ok));
  assert.equal(ok.statusCode, 200);
  assert.equal(ok.responseExcerpt, 'done, and then');
  assert.match(ok.error ?? '', /^the response body was cut: /);
  assert.notEqual(ok.retryable, true);
  const failed = await executor.execute(call('/cut-503'), never);
  assert.equal(failed.outcome, 'failed', JSON.stringify(failed));
  assert.equal(failed.statusCode, 503);
  assert.match(failed.error ?? '', /^HTTP 503; the response body was cut: /);
  // An informational response (103) is not the answer: a reset after it is a connection error.
  const hinted = await executor.execute(call('/early-hints-then-cut'), never);
  assert.equal(hinted.outcome, 'failed', JSON.stringify(hinted));
  assert.equal(hinted.statusCode, null);
  assert.doesNotMatch(hinted.error ?? '', /HTTP 103/);
});

test('a cancel after the final status keeps the answer; the run timeout after it is still a timeout', async () => {
  // A draining worker that aborted here and handed the run back would have it called a second
  // time, though the target had answered 200.
  const cancel = new AbortController();
  const pending = executor.execute(call('/status-then-stall'), cancel.signal);
  setTimeout(() => cancel.abort(new Error('the worker stops')), 200);
  const kept = await pending;
  assert.equal(kept.outcome, 'succeeded', JSON.stringify(kept));
  assert.equal(kept.statusCode, 200);
  assert.equal(kept.responseExcerpt, 'accepted, and then');
  assert.match(kept.error ?? '', /^the response body was cut: .*the worker stops/);
  const late = await executor.execute(call('/status-then-stall', {}, 200), never);
  assert.equal(late.outcome, 'timeout', JSON.stringify(late));
  assert.equal(late.statusCode, null);
});

test('a refused connection and a bad target are failed attempts with the reason', async () => {
  const closed = createServer();
  closed.listen(0, '127.0.0.1');
  await once(closed, 'listening');
  const port = (closed.address() as AddressInfo).port;
  closed.close();
  await once(closed, 'close');
  const refused = await executor.execute(
    { ...call('/ok'), target: { url: `http://127.0.0.1:${port}/` } },
    never,
  );
  assert.equal(refused.outcome, 'failed');
  assert.match(refused.error ?? '', /ECONNREFUSED/);
  assert.notEqual(refused.retryable, false, 'a refused connection may work next time');

  const badMethod = await executor.execute(call('/ok', { method: 'TRACE' }), never);
  assert.equal(badMethod.outcome, 'failed');
  assert.match(badMethod.error ?? '', /TRACE is not supported/);
  assert.equal(badMethod.retryable, false);
  const badScheme = await executor.execute({ ...call('/ok'), target: { url: 'ftp://127.0.0.1/' } }, never);
  assert.equal(badScheme.outcome, 'failed');
  assert.match(badScheme.error ?? '', /target\.url/);
  assert.equal(badScheme.retryable, false);
  const metadata = await executor.execute(
    { ...call('/ok'), target: { url: 'http://169.254.169.254/' } },
    never,
  );
  assert.equal(metadata.outcome, 'failed');
  assert.equal(metadata.retryable, false, 'a denied literal address is refused for good');
});

test('many calls at once all complete on pooled connections', async () => {
  const reports = await Promise.all(Array.from({ length: 300 }, () => executor.execute(call('/ok'), never)));
  assert.ok(reports.every((r) => r.outcome === 'succeeded' && r.responseExcerpt === 'fine'));
});

test('a request HTTP cannot carry fails once, not retryable, and nothing is sent', async () => {
  const cases: Record<string, string>[] = [
    { 'X-Price': '5 €' },
    { 'X-Bell': 'a\u0007b' },
    { 'X-Del': 'a\u007fb' },
    { Expect: '100-continue' },
    { 'Transfer-Encoding': 'chunked' },
  ];
  for (const headers of cases) {
    const before = seen.length;
    const report = await executor.execute(call('/ok', { headers }), never);
    assert.equal(report.outcome, 'failed', JSON.stringify(headers));
    assert.equal(report.retryable, false, `${JSON.stringify(headers)} would fail every attempt`);
    assert.equal(seen.length, before, 'the target was not called');
  }
});

test("a call to one of the cluster's own endpoints is refused by address and port, by name too", async () => {
  const port = Number(new URL(base).port);
  const cluster = new ClusterEndpoints([{ host: '127.0.0.1', port, what: 'etcd' }]);
  const guarded = new HttpExecutor({ targetPolicy: compileTargetPolicy({ cluster }) });
  try {
    for (const url of [`${base}/ok`, `http://localhost:${port}/ok`, `http://127.0.0.2:${port}/ok`]) {
      const before = seen.length;
      const report = await guarded.execute({ ...call('/ok'), target: { url } }, never);
      assert.equal(report.outcome, 'failed', url);
      assert.match(report.error ?? '', /cluster's own etcd/, url);
      assert.equal(report.retryable, false);
      assert.equal(seen.length, before, `${url} was not called`);
    }
  } finally {
    await guarded.close();
  }
});
