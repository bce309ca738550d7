import assert from 'node:assert/strict';
import { test } from 'node:test';
import { peersOrEveryone } from '../../src/store/handoff.js';

// A hand-off (a stopping worker's runs, the reaper's re-queued ones) goes to the live workers
// other than the one the runs come from. When etcd cannot list them, it goes to every worker
// rather than to none: the hint is what saves the runs a wait for the polling fallback.

test('the listed peers when etcd answers', async () => {
  const errors: unknown[] = [];
  const peers = await peersOrEveryone(
    () => Promise.resolve(['w2', 'w3']),
    (err) => errors.push(err),
  );
  assert.deepEqual(peers, ['w2', 'w3']);
  assert.deepEqual(errors, []);
});

test('no list (etcd unreachable): none named, so every worker receives the hand-off, and the reason is heard', async () => {
  const errors: unknown[] = [];
  const peers = await peersOrEveryone(
    () => Promise.reject(new Error('listing the workers timed out')),
    (err) => errors.push(err),
  );
  assert.deepEqual(peers, []);
  assert.deepEqual(
    errors.map((e) => (e as Error).message),
    ['listing the workers timed out'],
  );
});
