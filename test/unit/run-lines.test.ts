import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { createLogger } from '../../src/observability/logger.js';
import { RunLines } from '../../src/observability/run-lines.js';

/** A logger writing JSON lines synchronously into `lines`. */
function capturingLogger() {
  const lines: Record<string, unknown>[] = [];
  const destination = new Writable({
    write(chunk: Buffer, _encoding, done) {
      for (const line of chunk.toString().split('\n').filter(Boolean)) lines.push(JSON.parse(line));
      done();
    },
  });
  return { logger: createLogger({ level: 'info', nodeId: 'n1', destination }), lines };
}

test('past the budget, lines are counted by message and said in one line at the level of the most severe', () => {
  const { logger, lines } = capturingLogger();
  const budget = new RunLines(logger, 3);
  for (let i = 0; i < 10; i++) {
    const log = budget.forRun(logger, () => ({ run: `r${i}` }));
    if (i === 9) log.warn({ status: 503 }, 'run is dead: attempts exhausted');
    else log.info({ status: 503 }, 'attempt failed; retrying');
  }
  assert.deepEqual(
    lines.map((l) => [l.run, l.msg, l.status]),
    [
      ['r0', 'attempt failed; retrying', 503],
      ['r1', 'attempt failed; retrying', 503],
      ['r2', 'attempt failed; retrying', 503],
    ],
  );
  budget.flush();
  assert.equal(lines.length, 4);
  assert.deepEqual(lines[3]!.leftOut, {
    'attempt failed; retrying': 6,
    'run is dead: attempts exhausted': 1,
  });
  assert.equal(lines[3]!.level, 40, 'warn: a warning was among the lines left out');
  assert.match(String(lines[3]!.msg), /^7 lines about single runs left out/);
  budget.flush();
  assert.equal(lines.length, 4, 'nothing more left out: no second line');
});

test('the budget is per second: the lines left out are said when the second ends, and lines flow again', async () => {
  const { logger, lines } = capturingLogger();
  const budget = new RunLines(logger, 2);
  for (let i = 0; i < 5; i++)
    budget.forRun(logger, () => ({ run: `a${i}` })).info('call aborted: claim lost');
  assert.equal(lines.length, 2);
  await sleep(1100);
  assert.equal(lines.length, 3, 'the line saying what was left out, without a flush');
  assert.deepEqual(lines[2]!.leftOut, { 'call aborted: claim lost': 3 });
  assert.equal(lines[2]!.level, 30);
  budget.forRun(logger, () => ({ run: 'b' })).error({ err: 'x' }, 'settling the attempt failed');
  assert.equal(lines.length, 4, 'a new second has its budget again');
  assert.equal(lines[3]!.run, 'b');
});

test('0 writes every line; a run whose lines are all left out costs no child logger', () => {
  const { logger, lines } = capturingLogger();
  const unlimited = new RunLines(logger, 0);
  for (let i = 0; i < 500; i++) unlimited.forRun(logger, () => ({ run: i })).info('attempt failed; retrying');
  assert.equal(lines.length, 500);

  const budget = new RunLines(logger, 1);
  let bound = 0;
  const bindings = () => {
    bound += 1;
    return {};
  };
  budget.forRun(logger, bindings).info('first');
  budget.forRun(logger, bindings).info('second');
  budget.forRun(logger, bindings).warn('third');
  assert.equal(bound, 1);
  budget.flush();
  assert.throws(() => new RunLines(logger, -1), RangeError);
});
