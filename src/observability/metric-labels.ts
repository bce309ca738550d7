import { MISFIRE_POLICIES } from '../model.js';

const POOLS = ['main', 'worker', 'leader'] as const;
const PRUNED_TABLES = ['outbox', 'runs'] as const;

/**
 * The labels of each labelled Helios metric (besides the registry's `node`), and every value each
 * can take. The metrics are typed from it (metrics.ts), so the compiler refuses a call site that
 * emits a value not listed; test/unit/alerts.test.ts holds the alert rules, their text and the
 * dashboard to it. A rule once named loop="dispatcher" where the code emits loop="dispatch": a
 * matcher on a value no node emits selects nothing, and its alert can never fire.
 */
export const METRIC_LABEL_VALUES = {
  helios_db_pool_in_use: { pool: POOLS },
  helios_db_pool_waiting: { pool: POOLS },
  helios_db_pool_size: { pool: POOLS },
  helios_db_pool_saturated_seconds_total: { pool: POOLS },
  helios_misfires_total: { policy: MISFIRE_POLICIES },
  helios_leader_pass_failures_total: { loop: ['dispatch', 'reaper'] },
  helios_runs_created_total: { state: ['queued'] },
  // Whatever the worker made of an attempt: the call's outcome (store/attempts.ts CallOutcome),
  // a call not made (attempt.ts NOT_MADE), or a claim lost or withdrawn before the outcome was written.
  helios_runs_executed_total: {
    outcome: [
      'succeeded',
      'failed',
      'timeout',
      'replaced',
      'cancelled',
      'stopping',
      'claim-too-late',
      'replace-failed',
      'start-failed',
      'claim-lost',
      'withdrawn',
    ],
  },
  helios_runs_reaped_total: { to: ['queued-uncharged', 'queued', 'dead'] },
  helios_reaper_passes_cut_total: { reason: ['statement_timeout', 'budget'] },
  helios_run_claims_total: {
    source: ['kafka', 'poll'],
    result: ['claimed', 'missed', 'skipped', 'early', 'waiting'],
  },
  helios_pruned_rows_total: { table: PRUNED_TABLES },
  helios_prune_passes_total: { table: PRUNED_TABLES, result: ['succeeded', 'incomplete', 'failed'] },
  helios_runs_skipped_total: { reason: ['concurrency-forbid', 'misfire'] },
} as const;

export type LabelledMetric = keyof typeof METRIC_LABEL_VALUES;

/** The labels one emission of metric `M` carries: each a value listed for it. */
export type LabelsOf<M extends LabelledMetric> = {
  -readonly [
    L in keyof (typeof METRIC_LABEL_VALUES)[M]
  ]: (typeof METRIC_LABEL_VALUES)[M][L] extends readonly (infer V)[] ? V : never;
};

/** A database pool a node tracks under helios_db_pool_*{pool}. */
export type PoolName = (typeof POOLS)[number];
/** A fenced leader loop, counted under helios_leader_pass_failures_total{loop}. */
export type LeaderLoopName = LabelsOf<'helios_leader_pass_failures_total'>['loop'];
