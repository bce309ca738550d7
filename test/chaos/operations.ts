/**
 * The operations nemesis: a seeded stream of REST API calls made while the faults happen —
 * create, PATCH (schedule, target, enabled, misfire), pause, resume, delete, trigger and dead-letter
 * replay — each recorded with its timestamps and answer, and folded into the reference model
 * (model.ts) of the job it touched.
 */
import { setTimeout as sleep } from 'node:timers/promises';
import type { ChaosApi, CallRecord } from './api-client.js';
import { addVersion, type JobHistory, type JobVersion } from './model.js';
import type { OpView } from './observations.js';
import { jobBody, MISFIRES, opsJob, type JobPlan } from './workload.js';

export const OP_KINDS = [
  'create',
  'patch-schedule',
  'patch-target',
  'patch-enabled',
  'patch-misfire',
  'pause',
  'resume',
  'delete',
  'trigger',
  'replay',
] as const;
export type OpKind = (typeof OP_KINDS)[number];

export interface OpRecord extends OpView {
  readonly kind: OpKind;
  readonly status?: number;
  readonly tries: number;
  readonly note?: string;
}

/**
 * How long a try that got no answer may still take effect: a request sent to a node frozen for
 * 2×TTL is served when the node runs again. The model stretches such a change over this long,
 * and the nemesis leaves the job alone meanwhile, so a late landing cannot undo a later change.
 */
const LOST_TRY_MS = 10_000;

/** The job `plan` asks for, as the model's versions describe it. */
function asked(plan: JobPlan): Omit<JobVersion, 'from0' | 'from1' | 'cause'> {
  return {
    exists: true,
    enabled: true,
    schedule: plan.schedule,
    targetPath: plan.path,
    misfire: plan.misfire,
    maxCatchUp: plan.maxCatchUp,
  };
}

/** Schedules a PATCH moves the ops jobs between. */
const SCHEDULES = ['* * * * * *', '*/2 * * * * *'];

export class Nemesis {
  readonly ops: OpRecord[] = [];
  readonly jobs: JobHistory[] = [];
  private created = 0;
  /** Jobs the nemesis leaves alone until then (a try that got no answer may still land). */
  private readonly busyUntil = new Map<string, number>();

  constructor(
    private readonly api: ChaosApi,
    private readonly random: () => number,
    private readonly targetUrl: string,
    /** Failing jobs whose target answers 200 from now on (the target reads it): healed before a replay. */
    private readonly healed: Set<string>,
    /**
     * Called with a job's id just before the nemesis deletes it (the chaos run reads its runs,
     * which the delete takes with the job: checker.ts readRunsBeforeDelete). Its failure does not
     * stop the delete.
     */
    private readonly beforeDelete?: (jobId: string) => Promise<void>,
  ) {}

  /** Creates a job through the API and starts its history; throws when the API refuses it. */
  async create(plan: JobPlan): Promise<JobHistory> {
    const { call, job } = await this.tryCreate(plan);
    if (!job) throw new Error(`creating ${plan.name} failed: ${JSON.stringify(call.answer)}`);
    return job;
  }

  /** Creates a job through the API: its history when the API made it, with the call either way. */
  private async tryCreate(plan: JobPlan): Promise<{ call: CallRecord; job?: JobHistory }> {
    const call = await this.api.call('POST', '/jobs', jobBody(plan, this.targetUrl));
    let made = call.answer?.body as { id?: string } | undefined;
    // A retried create whose first try took effect: the name is taken by our own job.
    if (call.answer?.status === 409 && call.lostTry) {
      const read = await this.api.call('GET', `/jobs/${encodeURIComponent(plan.name)}`);
      made = read.answer?.body as { id?: string } | undefined;
    }
    if (!made?.id) return { call };
    const job: JobHistory = {
      id: made.id,
      name: plan.name,
      role: plan.role,
      versions: [{ ...asked(plan), from0: call.sentAt, from1: call.answeredAt, cause: 'create' }],
    };
    this.jobs.push(job);
    return { call, job };
  }

  /** Runs operations until `until` (ms) or `signal`, one every 1–2 s; every kind at least once if time allows. */
  async run(until: number, signal: AbortSignal): Promise<void> {
    const pending = new Set<OpKind>(OP_KINDS);
    while (Date.now() < until && !signal.aborted) {
      const feasible = await this.feasibleKinds();
      const wanted = [...pending].filter((k) => feasible.includes(k));
      const from = wanted.length > 0 ? wanted : feasible;
      const kind = from[Math.floor(this.random() * from.length)]!;
      const record = await this.perform(kind);
      if (record) {
        this.ops.push(record);
        if (record.outcome === 'ok') pending.delete(kind);
      }
      await sleep(1000 + this.random() * 1000, undefined, { signal }).catch(() => undefined);
    }
  }

  private opsJobs(): JobHistory[] {
    return this.jobs.filter(
      (j) =>
        j.role === 'ops' &&
        j.versions.at(-1)!.exists &&
        j.uncertainFrom === undefined &&
        (this.busyUntil.get(j.id) ?? 0) < Date.now(),
    );
  }

  private async feasibleKinds(): Promise<OpKind[]> {
    const ops = this.opsJobs();
    const kinds: OpKind[] = [
      'create',
      'trigger',
      'patch-schedule',
      'patch-target',
      'patch-enabled',
      'patch-misfire',
      'pause',
    ];
    if (ops.some((j) => !j.versions.at(-1)!.enabled)) kinds.push('resume');
    if (ops.length > 3) kinds.push('delete');
    if ((await this.openDeadLetters()).length > 0) kinds.push('replay');
    return ops.length === 0 ? ['create'] : kinds;
  }

  private async openDeadLetters(): Promise<{ id: string; runId: string; jobId: string; attempt: number }[]> {
    const call = await this.api.call('GET', '/dead-letters?open=true&limit=100');
    const items = (
      call.answer?.body as { items?: { id: string; runId: string; jobId: string; attempt: number }[] }
    )?.items;
    const failing = new Set(this.jobs.filter((j) => j.role === 'failing').map((j) => j.id));
    return (items ?? []).filter((d) => failing.has(d.jobId));
  }

  private pick<T>(items: T[]): T {
    return items[Math.floor(this.random() * items.length)]!;
  }

  private record(
    kind: OpKind,
    job: JobHistory | undefined,
    call: CallRecord,
    extra: Partial<OpRecord> = {},
  ): OpRecord {
    const status = call.answer?.status;
    const outcome =
      status !== undefined && status < 300
        ? 'ok'
        : status !== undefined && !call.lostTry
          ? 'refused'
          : 'unknown';
    return {
      kind,
      jobId: job?.id,
      jobName: job?.name,
      sentAt: call.sentAt,
      answeredAt: call.answeredAt,
      outcome,
      status,
      tries: call.tries,
      lostTry: call.lostTry,
      ...extra,
    };
  }

  /** Folds an answered change into the job's history, or marks the job unjudged from the call on. */
  private apply(
    job: JobHistory,
    record: OpRecord,
    change: Parameters<typeof addVersion>[1],
    from0 = record.sentAt,
  ) {
    const lateAsMs = record.lostTry ? LOST_TRY_MS : 0;
    if (lateAsMs > 0) this.busyUntil.set(job.id, record.answeredAt + lateAsMs);
    if (record.outcome === 'ok')
      addVersion(job, change, {
        from0,
        from1: record.answeredAt + lateAsMs,
        cause: `${record.kind} at ${new Date(record.sentAt).toISOString()}`,
      });
    else if (record.outcome === 'unknown')
      job.uncertainFrom = Math.min(job.uncertainFrom ?? Infinity, record.sentAt);
  }

  private async perform(kind: OpKind): Promise<OpRecord | undefined> {
    const ops = this.opsJobs();
    switch (kind) {
      case 'create': {
        const plan = opsJob(`ops-new-${this.created++}`, this.created);
        const sentAt = Date.now();
        const { call, job } = await this.tryCreate(plan).catch(() => ({ call: undefined, job: undefined }));
        // A try that got no answer may make the job late, under an id nobody saw, even after a
        // delete of the job the retry made (seed 93): the checker judges such a job by this plan
        // (check-unknown-jobs.ts). Left alone (not deleted) meanwhile, the job holds the name, so a
        // try landing then is refused as a duplicate.
        if (job && call.lostTry) this.busyUntil.set(job.id, call.answeredAt + LOST_TRY_MS);
        return {
          kind,
          jobId: job?.id,
          jobName: plan.name,
          sentAt: call?.sentAt ?? sentAt,
          answeredAt: call?.answeredAt ?? Date.now(),
          outcome: job ? 'ok' : 'unknown',
          status: job ? 201 : call?.answer?.status,
          tries: call?.tries ?? 1,
          lostTry: call?.lostTry ?? true,
          plan: { role: plan.role, ...asked(plan) },
        };
      }
      case 'pause':
      case 'resume':
      case 'patch-enabled': {
        const want = kind === 'pause' ? true : kind === 'resume' ? false : undefined;
        const candidates = ops.filter((j) => want === undefined || j.versions.at(-1)!.enabled === want);
        if (candidates.length === 0) return undefined;
        const job = this.pick(candidates);
        const enabled = !job.versions.at(-1)!.enabled;
        const call =
          kind === 'patch-enabled'
            ? await this.api.call('PATCH', `/jobs/${job.id}`, { enabled })
            : await this.api.call('POST', `/jobs/${job.id}/${kind}`);
        const record = this.record(kind, job, call, { note: `enabled → ${enabled}` });
        this.apply(job, record, { enabled });
        return record;
      }
      case 'patch-schedule': {
        const job = this.pick(ops);
        const schedule = SCHEDULES.find((s) => s !== job.versions.at(-1)!.schedule)!;
        const call = await this.api.call('PATCH', `/jobs/${job.id}`, { schedule });
        const record = this.record(kind, job, call, { note: `schedule → ${schedule}` });
        this.apply(job, record, { schedule });
        return record;
      }
      case 'patch-target': {
        const job = this.pick(ops);
        const version = Number(/\/v(\d+)$/.exec(job.versions.at(-1)!.targetPath)?.[1] ?? 0) + 1;
        const targetPath = `/ok/${job.name}/v${version}`;
        const call = await this.api.call('PATCH', `/jobs/${job.id}`, {
          target: { url: `${this.targetUrl}${targetPath}`, method: 'POST', body: { job: job.name, version } },
        });
        const record = this.record(kind, job, call, { note: `target → ${targetPath}` });
        this.apply(job, record, { targetPath });
        return record;
      }
      case 'patch-misfire': {
        // Runs made ahead copy the policy (runs.misfire): the occurrences after the edit must follow
        // the new one, those before it the old, whichever of the leader, a command and a worker
        // judges them late.
        const job = this.pick(ops);
        const { misfire: now } = job.versions.at(-1)!;
        const { misfire, maxCatchUp } = this.pick(MISFIRES.filter((m) => m.misfire !== now));
        const call = await this.api.call('PATCH', `/jobs/${job.id}`, { misfire, maxCatchUp });
        const record = this.record(kind, job, call, {
          note: `misfire → ${misfire}${misfire === 'fire-all' ? ` ${maxCatchUp}` : ''}`,
        });
        this.apply(job, record, { misfire, maxCatchUp });
        return record;
      }
      case 'delete': {
        const job = this.pick(ops);
        await this.beforeDelete?.(job.id).catch(() => undefined);
        const call = await this.api.call('DELETE', `/jobs/${job.id}`);
        // A retried delete whose first try took effect answers 404.
        const gone = call.answer?.status === 404 && call.lostTry;
        const record = this.record(kind, job, gone ? { ...call, answer: { status: 204, body: null } } : call);
        // Runs due shortly before a delete may be deleted with the job before they execute.
        this.apply(job, record, { exists: false }, record.sentAt - 10_000);
        return record;
      }
      case 'trigger': {
        const job = this.pick(ops);
        const call = await this.api.call('POST', `/jobs/${job.id}/trigger`, undefined, false);
        const runId = (call.answer?.body as { runId?: string } | undefined)?.runId;
        return this.record(kind, job, call, { runId });
      }
      case 'replay': {
        const letters = await this.openDeadLetters();
        if (letters.length === 0) return undefined;
        const letter = this.pick(letters);
        const job = this.jobs.find((j) => j.id === letter.jobId)!;
        this.healed.add(job.name);
        const call = await this.api.call('POST', `/dead-letters/${letter.id}/replay`);
        // A retried replay whose first try took effect answers 409.
        const done = call.answer?.status === 409 && call.lostTry;
        const record = this.record(
          kind,
          job,
          done ? { ...call, answer: { status: 202, body: null } } : call,
          {
            runId: letter.runId,
            deadAttempt: letter.attempt,
          },
        );
        return record;
      }
    }
  }
}
