// A demo HTTP target for `npm run cluster`: prints one line per call it receives.
// Usage: node scripts/demo-target.mjs PORT
import { createServer } from 'node:http';

const port = Number(process.argv[2] ?? 9099);
let calls = 0;
createServer((req, res) => {
  const scheduled = req.headers['x-helios-scheduled-for'];
  const lateMs = scheduled ? Date.now() - Date.parse(String(scheduled)) : NaN;
  calls += 1;
  // /flaky fails every other call, so retries and dead letters can be seen too.
  const fail = req.url?.startsWith('/flaky') && calls % 2 === 0;
  process.stdout.write(
    `${new Date().toISOString()} ${req.method} ${req.url} job=${req.headers['x-helios-job-id']} ` +
      `run=${req.headers['x-helios-run-id']} attempt=${req.headers['x-helios-attempt']} ` +
      `late=${Number.isNaN(lateMs) ? '-' : `${lateMs}ms`} → ${fail ? 500 : 200}\n`,
  );
  req.resume();
  req.on('end', () => {
    res.writeHead(fail ? 500 : 200, { 'content-type': 'application/json' });
    res.end(JSON.stringify({ ok: !fail }));
  });
}).listen(port, '127.0.0.1', () =>
  process.stdout.write(`demo target listening on http://127.0.0.1:${port}\n`),
);
