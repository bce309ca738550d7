// Preloaded into a node (NODE_OPTIONS=--import) by a test that must show what the worker's gate
// in front of the node's pool (src/store/pool-share.ts) prevents: it makes the gate let every
// caller through at once, so the worker can take every connection of the node's pool.
import { PoolShare } from '../../dist/store/pool-share.js';

PoolShare.prototype.acquire = async function acquireWithoutLimit() {
  this.active += 1;
  let released = false;
  return () => {
    if (released) return;
    released = true;
    this.active -= 1;
  };
};
