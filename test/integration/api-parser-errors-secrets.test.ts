import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { after, before, test } from 'node:test';
import { ADMIN, VIEWER, startTestApi, type TestApi } from '../support/api.js';
import { uniqueId } from '../support/env.js';

// A request Node's HTTP parser refuses is answered with a problem and logged (trace): the log line
// names the parser's error, never the bytes read so far (the error carries them as rawPacket: the
// request's Authorization header, and a job's secret headers from the part of its body read).
// Before, at trace level, the whole error was logged, bytes included (found by a review, helper-56).

let api: TestApi;
before(async () => {
  api = await startTestApi({
    tokens: new Map([
      [ADMIN, 'admin'],
      [VIEWER, 'viewer'],
    ]),
  });
});
after(() => api.close());

/** Writes `raw` to the API server's socket and returns what came back before it closed. */
function rawRequest(raw: string): Promise<string> {
  const { port } = new URL(api.url);
  return new Promise((resolve, reject) => {
    const socket = connect(Number(port), '127.0.0.1');
    let answer = '';
    socket.on('data', (d) => (answer += d.toString()));
    socket.on('error', () => resolve(answer));
    socket.on('close', () => resolve(answer));
    socket.on('connect', () => socket.write(raw));
    setTimeout(() => reject(new Error('no answer')), 5000).unref();
  });
}

/** Every log line, with any Buffer logged as {type:'Buffer',data:[…]} decoded back into text. */
function logText(): string {
  return api.logs
    .map((line) =>
      line.replace(/\{"type":"Buffer","data":\[([0-9,]*)\]\}/g, (_m, bytes: string) =>
        Buffer.from(bytes.split(',').filter(Boolean).map(Number)).toString('latin1'),
      ),
    )
    .join('\n');
}

test("a request the HTTP parser refuses: neither the API token nor a job's secret reaches the log", async () => {
  const tag = uniqueId();
  const jobSecret = `job-secret-${tag}`;
  const body = JSON.stringify({
    name: `leak-${tag}`,
    schedule: '*/5 * * * *',
    target: { url: 'http://127.0.0.1:9/hook', headers: { Authorization: `Bearer ${jobSecret}` } },
  });
  // A chunked body whose second chunk size is not hex: refused after the first chunk (the job with
  // its secret) was read.
  const answer = await rawRequest(
    `POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ${ADMIN}\r\n` +
      `Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n` +
      `${Buffer.byteLength(body).toString(16)}\r\n${body}\r\nzz\r\n`,
  );
  assert.match(answer, /^HTTP\/1\.1 400/);
  // A bad Content-Length: refused in the headers.
  await rawRequest(
    `GET /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ${VIEWER}\r\nContent-Length: x1\r\n\r\n`,
  );
  await new Promise((r) => setTimeout(r, 200));
  assert.ok(
    api.logs.filter((l) => l.includes('client error')).length >= 2,
    'both refusals were logged (at trace)',
  );
  const logs = logText();
  assert.deepEqual(
    [ADMIN, VIEWER, jobSecret].filter((s) => logs.includes(s)),
    [],
    'secrets in the log',
  );
});
