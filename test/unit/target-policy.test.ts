import assert from 'node:assert/strict';
import { once } from 'node:events';
import { createServer, get, type Server } from 'node:http';
import { after, before, test } from 'node:test';
import { Agent, request } from 'undici';
import {
  assertTargetAllowed,
  checkTargetUrl,
  CidrRange,
  compileTargetPolicy,
  deniedReason,
  guardedLookup,
  InvalidCidrError,
  TargetDeniedError,
} from '../../src/security/target-policy.js';
import { HttpExecutor } from '../../src/execution/http-executor.js';
import { ClusterEndpoints, endpointsOfEtcdMembers } from '../../src/security/cluster-endpoints.js';

const defaults = compileTargetPolicy();
// Loopback denied too: a name that resolves to 127.0.0.1 / ::1 (localhost, from /etc/hosts, no
// network needed) then stands for "a hostname that resolves into a denied range".
const noLoopback = compileTargetPolicy({ deny: ['169.254.0.0/16', '127.0.0.0/8', '::1/128'] });

let server: Server;
let port: number;
let hits = 0;
before(async () => {
  server = createServer((_req, res) => {
    hits += 1;
    res.end('reached');
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  port = (server.address() as { port: number }).port;
});
after(() => server.close());

test('CIDR ranges and single addresses parse; garbage is an InvalidCidrError', () => {
  assert.ok(CidrRange.parse('10.0.0.0/8'));
  assert.ok(CidrRange.parse('fd00::/8'));
  assert.ok(CidrRange.parse('192.0.2.7'));
  for (const bad of ['10.0.0.0/33', 'fe80::/129', 'nope', '10.0.0/8', '1.2.3.4/x', '']) {
    assert.throws(() => CidrRange.parse(bad), InvalidCidrError, bad);
  }
});

test('the default policy denies cloud metadata and link-local, allows loopback and public addresses', () => {
  assert.match(deniedReason('169.254.169.254', defaults) ?? '', /169\.254\.0\.0\/16/);
  assert.ok(deniedReason('fe80::1', defaults));
  assert.ok(deniedReason('fd00:ec2::254', defaults));
  assert.ok(deniedReason('100.100.100.200', defaults));
  assert.ok(deniedReason('0.0.0.0', defaults));
  // IPv4-mapped IPv6 cannot dodge an IPv4 range.
  assert.ok(deniedReason('::ffff:169.254.169.254', defaults));
  assert.equal(deniedReason('127.0.0.1', defaults), null);
  assert.equal(deniedReason('203.0.113.9', defaults), null);
});

test('an allow list admits only its ranges, and deny wins inside it', () => {
  const policy = compileTargetPolicy({ deny: ['10.0.9.0/24'], allow: ['10.0.0.0/16'] });
  assert.equal(deniedReason('10.0.1.1', policy), null);
  assert.match(deniedReason('10.1.0.1', policy) ?? '', /outside the allowed ranges/);
  assert.match(deniedReason('10.0.9.9', policy) ?? '', /denied range 10\.0\.9\.0\/24/);
});

test('checkTargetUrl refuses other schemes, credentials and denied literals in any spelling', () => {
  assert.equal(checkTargetUrl('https://example.com/x?y=1', defaults), null);
  assert.match(checkTargetUrl('ftp://example.com/', defaults) ?? '', /http or https/);
  assert.match(checkTargetUrl('not a url', defaults) ?? '', /absolute URL/);
  assert.match(checkTargetUrl('http://user:pw@example.com/', defaults) ?? '', /credentials/);
  for (const url of [
    'http://169.254.169.254/latest/meta-data/',
    'http://2852039166/', // decimal
    'http://0xA9FEA9FE/', // hex
    'http://169.254.43518/', // mixed
    'http://[::ffff:169.254.169.254]/',
    'http://[fe80::1]:8080/',
  ]) {
    assert.ok(checkTargetUrl(url, defaults), `${url} should be refused`);
  }
});

test('assertTargetAllowed refuses a hostname whose resolved address is denied', async () => {
  await assert.rejects(assertTargetAllowed(`http://localhost:${port}/`, noLoopback), (err: unknown) => {
    assert.ok(err instanceof TargetDeniedError);
    assert.equal(err.hostname, 'localhost');
    assert.match(err.reason, /denied range/);
    return true;
  });
  const resolved = await assertTargetAllowed(`http://localhost:${port}/`, defaults);
  assert.ok(resolved.some((a) => a.address === '127.0.0.1' || a.address === '::1'));
});

test('assertTargetAllowed checks every address of a name (injected resolver)', async () => {
  const resolver = async () => [
    { address: '203.0.113.10', family: 4 },
    { address: '169.254.169.254', family: 4 },
  ];
  await assert.rejects(assertTargetAllowed('http://rebind.example/', defaults, resolver), TargetDeniedError);
  await assert.rejects(
    assertTargetAllowed('http://empty.example/', defaults, async () => []),
    TargetDeniedError,
  );
  await assert.rejects(assertTargetAllowed('http://169.254.169.254/', defaults, resolver), TargetDeniedError);
});

test('guardedLookup makes node:http refuse to connect to a denied name', async () => {
  const req = get({ host: 'localhost', port, lookup: guardedLookup(noLoopback) });
  const [err] = (await once(req, 'error')) as [Error];
  assert.ok(err instanceof TargetDeniedError, String(err));
});

test('guardedLookup in an undici Agent refuses a denied name and allows an allowed one', async () => {
  const denied = new Agent({ connect: { lookup: guardedLookup(noLoopback) } });
  const allowed = new Agent({ connect: { lookup: guardedLookup(defaults) } });
  try {
    await assert.rejects(
      request(`http://localhost:${port}/`, { dispatcher: denied }),
      (err: unknown) => err instanceof TargetDeniedError || (err as Error).cause instanceof TargetDeniedError,
    );
    const response = await request(`http://localhost:${port}/`, { dispatcher: allowed });
    assert.equal(await response.body.text(), 'reached');
  } finally {
    await Promise.all([denied.close(), allowed.close()]);
  }
});

test("the worker's HTTP executor refuses, at execution time, a name that resolves into a denied range", async () => {
  const executor = new HttpExecutor({ targetPolicy: noLoopback });
  const before = hits;
  try {
    const report = await executor.execute(
      {
        id: '00000000-0000-4000-8000-000000000001',
        jobId: '00000000-0000-4000-8000-000000000002',
        attempt: 1,
        maxAttempts: 1,
        scheduledFor: new Date(),
        target: { url: `http://localhost:${port}/hook`, method: 'POST', headers: {} },
        timeoutMs: 5000,
        backoffMs: 0,
        backoffMultiplier: 1,
        concurrency: 'allow',
        claimExpiresAt: new Date(Date.now() + 10_000),
      },
      new AbortController().signal,
    );
    assert.equal(report.outcome, 'failed');
    assert.match(report.error ?? '', /denied range 127\.0\.0\.0\/8|denied range ::1/);
    assert.equal(report.retryable, false, 'a refused address is not tried again');
    assert.equal(hits, before, 'the target must not have been called');
  } finally {
    await executor.close();
  }
});

test('the defaults deny Azure wire server and always apply, whatever deny is added', () => {
  const added = compileTargetPolicy({ deny: ['10.0.0.0/8'] });
  assert.ok(deniedReason('169.254.169.254', added), 'adding a range keeps the metadata address denied');
  assert.ok(deniedReason('168.63.129.16', added));
  assert.ok(deniedReason('10.2.3.4', added));
  assert.equal(deniedReason('169.254.169.254', compileTargetPolicy({ defaults: false })), null);
});

test('IPv6 transition forms of a denied IPv4 address are denied (NAT64, 6to4, Teredo, compatible, mapped)', () => {
  for (const address of [
    '64:ff9b::a9fe:a9fe', // NAT64 of 169.254.169.254
    '64:ff9b::169.254.169.254',
    '2002:a9fe:a9fe::1', // 6to4
    '2001:0:4136:e378:8000:63bf:5601:5601', // Teredo, client 169.254.169.254 stored inverted
    '::169.254.169.254', // IPv4-compatible
    '::ffff:169.254.169.254', // IPv4-mapped
    '::ffff:a9fe:a9fe',
    '64:ff9b::a83f:8110', // 168.63.129.16
  ]) {
    assert.match(deniedReason(address, defaults) ?? '', /denied range/, address);
  }
  for (const url of ['http://[64:ff9b::a9fe:a9fe]/', 'http://[2002:a9fe:a9fe::]/', 'http://[::a9fe:a9fe]/']) {
    assert.ok(checkTargetUrl(url, defaults), `${url} should be refused`);
  }
  // Loopback and the unspecified address are not read as IPv4-compatible 0.0.0.1 / 0.0.0.0.
  assert.equal(deniedReason('::1', defaults), null);
  assert.equal(deniedReason('2002:cb00:7109::1', defaults), null, '6to4 of a public address is fine');
  const strict = compileTargetPolicy({ strict: true });
  assert.ok(deniedReason('64:ff9b::7f00:1', strict), 'NAT64 of 127.0.0.1 in strict mode');
  assert.ok(deniedReason('2002:0a00:0001::1', strict), '6to4 of 10.0.0.1 in strict mode');
});

test('a cluster endpoint given by name is refused once resolved, and stays refused when DNS fails', async () => {
  let answer: () => Promise<string[]> = async () => ['10.9.8.7'];
  const cluster = new ClusterEndpoints([{ host: 'etcd.internal', port: 2379, what: 'etcd' }], () => answer());
  const policy = compileTargetPolicy({ cluster });
  assert.equal(deniedReason('10.9.8.7', policy, 2379), null, 'not resolved yet');
  await cluster.refresh();
  assert.match(deniedReason('10.9.8.7', policy, 2379) ?? '', /cluster's own etcd/);
  assert.equal(deniedReason('10.9.8.7', policy, 80), null, 'only its port');
  answer = async () => {
    throw new Error('SERVFAIL');
  };
  await cluster.refresh();
  assert.ok(deniedReason('10.9.8.7', policy, 2379), 'a DNS failure must not open the port');
  cluster.setDiscovered('nodes', [{ host: '10.1.1.1', port: 8080, what: 'node API' }]);
  assert.match(deniedReason('10.1.1.1', policy, 8080) ?? '', /node API/);
});

test('a target naming a cluster endpoint by its name is refused on its port, wherever the name points now', async () => {
  let address = '10.9.8.7';
  const cluster = new ClusterEndpoints([{ host: 'etcd.internal', port: 2379, what: 'etcd' }], async () => [
    address,
  ]);
  const policy = compileTargetPolicy({ cluster });
  await cluster.refresh();
  // etcd moved: the name points to its new address, which the next refresh (10 s) would learn.
  address = '10.9.8.8';
  const resolve = async () => [{ address, family: 4 }];
  for (const url of ['http://etcd.internal:2379/v3/kv/put', 'http://ETCD.Internal.:2379/v3/kv/put']) {
    assert.match(checkTargetUrl(url, policy) ?? '', /cluster's own etcd/, url);
    await assert.rejects(assertTargetAllowed(url, policy, resolve), /cluster's own etcd/, url);
  }
  assert.equal(checkTargetUrl('http://etcd.internal:8080/', policy), null, 'only its port');
});

test('the last good answers of names no longer listed are forgotten: node restarts do not grow memory', async () => {
  // A node bound to 0.0.0.0 registers http://<hostname>:port, and a pod gets a new hostname at
  // every restart: over months of rolling upgrades each node would keep an answer per hostname
  // its peers ever had.
  let now = 0;
  const cluster = new ClusterEndpoints(
    [],
    async () => ['10.3.0.1'],
    () => now,
  );
  const remembered = () => (cluster as unknown as { lastGood: Map<string, unknown> }).lastGood.size;
  for (let restart = 0; restart < 200; restart++) {
    cluster.setDiscovered('nodes', [
      { host: 'helios-stable', port: 8080, what: 'node API' },
      { host: `helios-pod-${restart}`, port: 8080, what: 'node API' },
    ]);
    await cluster.refresh();
    now += 10 * 60_000; // ten minutes between restarts
  }
  assert.ok(remembered() <= 10, `${remembered()} names remembered after 200 restarts`);
  // A name that left a moment ago keeps its answer (it may come back while DNS fails).
  const policy = compileTargetPolicy({ cluster });
  cluster.setDiscovered('nodes', [{ host: 'helios-stable', port: 8080, what: 'node API' }]);
  await cluster.refresh();
  now += 60_000;
  cluster.setDiscovered('nodes', [{ host: 'helios-pod-199', port: 8080, what: 'node API' }]);
  assert.match(deniedReason('10.3.0.1', policy, 8080) ?? '', /node API/);
});

test("every etcd member's client and peer URLs are refused, each source replacing only its own", () => {
  const cluster = new ClusterEndpoints([]);
  const policy = compileTargetPolicy({ cluster });
  cluster.setDiscovered(
    'etcd members',
    endpointsOfEtcdMembers([
      { clientURLs: ['http://10.2.0.1:2379'], peerURLs: ['http://10.2.0.1:2380'] },
      { clientURLs: ['https://10.2.0.2'], peerURLs: ['http://[fd00::2]'] },
    ]),
  );
  // Kafka's metadata names an IPv6 broker without brackets.
  cluster.setDiscovered('kafka brokers', [
    { host: '10.3.0.1', port: 9092, what: 'Kafka broker' },
    { host: 'fd00::3', port: 9092, what: 'Kafka broker' },
  ]);
  assert.match(deniedReason('fd00::3', policy, 9092) ?? '', /Kafka broker/);
  assert.match(deniedReason('10.2.0.1', policy, 2379) ?? '', /cluster's own etcd$/);
  assert.match(deniedReason('10.2.0.1', policy, 2380) ?? '', /cluster's own etcd peer/);
  assert.match(
    deniedReason('10.2.0.2', policy, 2379) ?? '',
    /etcd/,
    "a client URL without a port is etcd's 2379",
  );
  assert.match(
    deniedReason('fd00::2', policy, 2380) ?? '',
    /etcd peer/,
    "a peer URL without a port is etcd's 2380",
  );
  assert.equal(deniedReason('10.2.0.1', policy, 8080), null, 'only their ports');
  // A member removed: the next answer replaces the members, and leaves the brokers.
  cluster.setDiscovered(
    'etcd members',
    endpointsOfEtcdMembers([{ clientURLs: [], peerURLs: ['http://10.2.0.1:2380'] }]),
  );
  assert.equal(deniedReason('10.2.0.2', policy, 2379), null);
  assert.ok(deniedReason('10.2.0.1', policy, 2380));
  assert.match(deniedReason('10.3.0.1', policy, 9092) ?? '', /Kafka broker/);
});
