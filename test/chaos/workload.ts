/**
 * The jobs of the chaos run and how the target answers them. Every job is made through the REST
 * API, so the reference model starts from the API's answers:
 * - steady: every second, never touched by operations; misfire `fire-once`, `skip`, or
 *   `fire-all` with maxCatchUp 2, so a missed occurrence shows (nothing back-fills it);
 * - ops: every second, `fire-once` or `skip` at first; the operations nemesis pauses, resumes,
 *   patches (the misfire policy too, to any of the three), triggers and deletes them;
 * - failing: the target answers 500 until the job is healed (just before a replay), two
 *   attempts, so dead letters exist to replay;
 * - forbid: a call takes about one period (some first attempts fail and retry), so occurrences
 *   find the previous run still active;
 * - replace: a call takes longer than the period, so each run is replaced by the next.
 */
import type { Behaviour, TargetRequest } from '../support/execution.js';
import type { JobRole, Misfire } from './model.js';

export interface JobPlan {
  readonly name: string;
  readonly role: JobRole;
  readonly schedule: string;
  readonly misfire: Misfire;
  readonly maxCatchUp: number;
  readonly concurrency: 'allow' | 'forbid' | 'replace';
  readonly timeoutMs: number;
  readonly maxAttempts: number;
  readonly backoffMs: number;
  /** The target path; a PATCH of the target moves it to the next version. */
  readonly path: string;
}

/** The misfire policies of the jobs, and those a PATCH moves the ops jobs between. */
export const MISFIRES: { misfire: Misfire; maxCatchUp: number }[] = [
  { misfire: 'fire-once', maxCatchUp: 100 },
  { misfire: 'skip', maxCatchUp: 100 },
  { misfire: 'fire-all', maxCatchUp: 2 },
];

export function initialJobs(steady: number, ops: number): JobPlan[] {
  const plans: JobPlan[] = [];
  const base = { timeoutMs: 5000, maxAttempts: 5, backoffMs: 200, concurrency: 'allow' as const };
  for (let i = 0; i < steady; i++)
    plans.push({
      ...base,
      ...MISFIRES[i % 3]!,
      name: `steady-${i}`,
      role: 'steady',
      schedule: '* * * * * *',
      path: `/ok/steady-${i}/v0`,
    });
  for (let i = 0; i < ops; i++) plans.push(opsJob(`ops-${i}`, i));
  for (let i = 0; i < 2; i++)
    plans.push({
      ...base,
      ...MISFIRES[0]!,
      name: `failing-${i}`,
      role: 'failing',
      schedule: '*/4 * * * * *',
      maxAttempts: 2,
      backoffMs: 100,
      path: `/fail/failing-${i}/v0`,
    });
  plans.push({
    ...MISFIRES[0]!,
    name: 'forbid-0',
    role: 'forbid',
    schedule: '*/2 * * * * *',
    concurrency: 'forbid',
    timeoutMs: 6000,
    maxAttempts: 3,
    backoffMs: 100,
    path: '/forbid/forbid-0/v0',
  });
  plans.push({
    ...MISFIRES[0]!,
    name: 'replace-0',
    role: 'replace',
    schedule: '*/2 * * * * *',
    concurrency: 'replace',
    timeoutMs: 6000,
    maxAttempts: 3,
    backoffMs: 100,
    path: '/replace/replace-0/v0',
  });
  return plans;
}

/** An every-second job for the operations to work on. */
export function opsJob(name: string, i: number): JobPlan {
  return {
    ...MISFIRES[i % 2]!,
    name,
    role: 'ops',
    schedule: '* * * * * *',
    concurrency: 'allow',
    timeoutMs: 5000,
    maxAttempts: 5,
    backoffMs: 200,
    path: `/ok/${name}/v0`,
  };
}

/** The body of POST /jobs for a plan, calling `targetUrl` + its path. */
export function jobBody(plan: JobPlan, targetUrl: string): Record<string, unknown> {
  return {
    name: plan.name,
    schedule: plan.schedule,
    target: { url: `${targetUrl}${plan.path}`, method: 'POST', body: { job: plan.name } },
    timeoutMs: plan.timeoutMs,
    retry: { maxAttempts: plan.maxAttempts, backoffMs: plan.backoffMs, backoffMultiplier: 1 },
    concurrency: plan.concurrency,
    misfire: plan.misfire,
    maxCatchUp: plan.maxCatchUp,
  };
}

/** A small deterministic hash of a string to [0, 1), so answers do not depend on Math.random. */
function unit(text: string): number {
  let h = 2166136261;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619);
  return (h >>> 0) / 4294967296;
}

/** How the target answers: by the first segment of the path; `healed` names failing jobs that now succeed. */
export function targetBehaviour(healed: ReadonlySet<string>): Behaviour {
  return (request: TargetRequest) => {
    const [, kind, name] = request.path.split('/');
    const r = unit(`${request.runId}/${request.attempt}`);
    switch (kind) {
      case 'fail':
        return { status: healed.has(name ?? '') ? 200 : 500, delayMs: 20 };
      case 'forbid':
        // About one period (2 s); a third of the first attempts fail, so retries meet new occurrences.
        return {
          status: request.attempt === 1 && unit(request.runId) < 1 / 3 ? 500 : 200,
          delayMs: 1700 + r * 600,
        };
      case 'replace':
        return { status: 200, delayMs: 2600 + r * 600 };
      default:
        return { status: 200, delayMs: 50 + r * 250 };
    }
  };
}
