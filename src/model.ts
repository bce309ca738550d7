// Types every layer shares. They live here, below every folder, so that no layer has to import
// another sideways or upwards to name a policy or a run (store/ used to import scheduling/ for
// MisfirePolicy). A new job field is declared in JobFields (store/jobs.ts); if runs copy it, it
// is also added to RunSnapshot and RUN_SNAPSHOT_FIELDS here and to COPIED_COLUMNS in
// store/dispatch.ts (runs are created, and replays recopied, from it).

export const MISFIRE_POLICIES = ['fire-once', 'fire-all', 'skip'] as const;
/** What the dispatcher does with occurrences missed while the cluster was down or leaderless. */
export type MisfirePolicy = (typeof MISFIRE_POLICIES)[number];

export const CONCURRENCY_POLICIES = ['allow', 'forbid', 'replace'] as const;
/** What happens to an occurrence while another run of the same job is active. */
export type ConcurrencyPolicy = (typeof CONCURRENCY_POLICIES)[number];

export const RUN_STATES = ['queued', 'running', 'succeeded', 'failed', 'dead', 'skipped'] as const;
export type RunState = (typeof RUN_STATES)[number];

/** Why a run exists: its job's schedule, or a manual trigger (POST /jobs/{id}/trigger). */
export type RunTrigger = 'schedule' | 'manual';

/** The HTTP call a job makes, as stored in `jobs.target` and snapshotted into each run. */
export interface StoredTarget {
  readonly url: string;
  readonly method: string;
  readonly headers: Readonly<Record<string, string>>;
  /** Any JSON value, sent JSON-encoded; absent for no body. */
  readonly body?: unknown;
}

/** What a run's HTTP call is made of: a snapshot of the job's `target` when the run was created. */
export interface RunTarget {
  readonly url: string;
  readonly method?: string;
  readonly headers?: Readonly<Record<string, string>>;
  readonly body?: unknown;
}

/**
 * The columns a run copies from its job when it is created, so that an edit of the job never
 * changes a run already created (an edit withdraws the runs created ahead instead).
 */
export interface RunSnapshot {
  readonly target: StoredTarget;
  readonly timeoutMs: number;
  readonly maxAttempts: number;
  readonly backoffMs: number;
  readonly backoffMultiplier: number;
  readonly concurrency: ConcurrencyPolicy;
}

/** The fields of RunSnapshot, for comparing two versions of a job. */
export const RUN_SNAPSHOT_FIELDS = [
  'target',
  'timeoutMs',
  'maxAttempts',
  'backoffMs',
  'backoffMultiplier',
  'concurrency',
] as const satisfies readonly (keyof RunSnapshot)[];

/**
 * A run announcement on the dispatch topic (written by the dispatcher, a manual trigger, a retry
 * or a replay through the outbox). Parsed and validated by execution/run-message.ts.
 */
export interface RunMessage {
  readonly runId: string;
  readonly jobId: string;
  /** The attempt the message announces (1 for a new run); a claim expects attempt − 1 done. */
  readonly attempt: number;
  readonly scheduledFor: Date;
  /** The earliest instant the attempt may start, by the database clock. */
  readonly notBefore: Date;
  /**
   * The run's timeout (its snapshot's), so a stopping worker can leave a run whose call could not
   * end before its drain deadline without claiming it. Absent from messages written before it was
   * added: such a run is claimed, and handed back if it does not fit.
   */
  readonly timeoutMs?: number;
  /**
   * The run's concurrency policy (its snapshot's): only an `allow` run is claimed ahead of its
   * time, so a worker holds the others for their time instead of trying a claim the database
   * refuses. Absent from older messages: claimed ahead, and held again when refused.
   */
  readonly concurrency?: ConcurrencyPolicy;
}

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
/** True for the text form of a UUID (job, run and dead-letter ids); job names never look like one. */
export const isUuid = (text: string): boolean => UUID.test(text);
