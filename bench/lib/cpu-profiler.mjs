// Preloaded into a Helios node by the benchmarks (`node --import bench/lib/cpu-profiler.mjs`):
// SIGUSR2 starts a V8 CPU profile, the next SIGUSR2 writes it to
// $HELIOS_BENCH_PROFILE_DIR/<pid>.cpuprofile, so a profile covers only the measured window
// (node's own --cpu-prof covers the whole life, start-up included). Bench tooling only.
import { writeFileSync } from 'node:fs';
import { Session } from 'node:inspector';
import process from 'node:process';

const dir = process.env.HELIOS_BENCH_PROFILE_DIR ?? '/tmp';
const session = new Session();
session.connect();
let profiling = false;

const post = (method, params = {}) =>
  new Promise((resolve, reject) =>
    session.post(method, params, (err, result) => (err ? reject(err) : resolve(result))),
  );

process.on('SIGUSR2', () => {
  const step = profiling
    ? post('Profiler.stop').then(({ profile }) =>
        writeFileSync(`${dir}/${process.pid}.cpuprofile`, JSON.stringify(profile)),
      )
    : post('Profiler.enable')
        .then(() => post('Profiler.setSamplingInterval', { interval: 500 }))
        .then(() => post('Profiler.start'));
  profiling = !profiling;
  step.catch((err) => process.stderr.write(`bench cpu profiler: ${err}\n`));
});
