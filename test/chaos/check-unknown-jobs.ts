/**
 * Jobs in the database that no answer of the API named. A create is not idempotent: a try the
 * client gave up on may still take effect, after its retry made the job on another node and even
 * after the nemesis deleted that one (seed 93: a node cut off from PostgreSQL sent its INSERT when
 * the link healed, and the name was free again). Such a late create is the job its create asked
 * for, made at an unknown instant from the create's sending to the end of the window: none of its
 * occurrences must run, and none before the create was sent may, but its runs are judged as any
 * other's (one call per attempt, a row per delivery, the target of its plan). Any other unknown
 * job was made by nobody.
 */
import type { JobHistory } from './model.js';
import { iso, type Findings, type Observations, report } from './observations.js';

/** The late creates among `obs.unknownJobs`, as jobs of the model, and the jobs nobody created. */
export function checkUnknownJobs(obs: Observations): Findings & { lateCreates: JobHistory[] } {
  const lateCreates: JobHistory[] = [];
  const strangers: string[] = [];
  for (const unknown of obs.unknownJobs ?? []) {
    const create = obs.ops.find(
      (o) => o.kind === 'create' && o.lostTry === true && o.jobName === unknown.name && o.plan,
    );
    if (!create?.plan) {
      strangers.push(
        `job ${unknown.id} (${unknown.name}): no create of that name had a try that got no answer`,
      );
      continue;
    }
    const { role, ...version } = create.plan;
    lateCreates.push({
      id: unknown.id,
      name: unknown.name,
      role,
      versions: [
        {
          ...version,
          from0: create.sentAt,
          from1: Math.max(create.sentAt, obs.windowEnd),
          cause: `create sent at ${iso(create.sentAt)}, which took effect late`,
        },
      ],
    });
  }
  const violations: string[] = [];
  report(violations, 'jobs nobody created', strangers);
  const names = lateCreates.map((j) => `${j.name} ${j.id}`).join(', ');
  return {
    violations,
    lines: [
      `jobs the API never named: late creates ${lateCreates.length}${names ? ` (${names})` : ''}, ` +
        `made by nobody ${strangers.length}`,
    ],
    lateCreates,
  };
}
