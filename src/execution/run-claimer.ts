import type { Connections } from '../store/pool-share.js';
import type { Metrics } from '../observability/metrics.js';
import {
  explainClaimMiss,
  skipMisfiredRun,
  skipRun,
  type ClaimedRun,
  type ClaimRequest,
  type EndedEpochsReading,
} from '../store/runs.js';
import type { ClaimResult } from './batching.js';
import type { DbClock } from './db-clock.js';
import type { RunMessage } from '../model.js';

/** What the run queue does after trying to claim an announced run. */
export type ClaimOutcome =
  /** Ours: execute it (from its not_before on). */
  | { readonly kind: 'claimed'; readonly run: ClaimedRun }
  /** Not ours yet: hold the announcement again until `notBefore`, without claiming ahead. */
  | { readonly kind: 'rehold'; readonly notBefore: Date }
  /** Nothing to do: another worker won, the run was skipped, or the poller will take it. */
  | { readonly kind: 'done' };

/** How often the announcement was held already, and whether it was claimed ahead of time. */
export interface HoldState {
  readonly retries: number;
  readonly early: boolean;
}

/** Options of {@link RunClaimer}. */
export interface RunClaimerOptions {
  readonly pool: Connections;
  /** Claims one run (batched with the others of this event-loop turn; execution/batching.ts). */
  readonly claim: (request: ClaimRequest) => Promise<ClaimResult>;
  /** A run may be claimed this long before its not_before (the claim's own tolerance). */
  readonly skewToleranceMs: number;
  /** Claims are tried this long before a run is due (ClaimOptions.leadMs). */
  readonly claimLeadMs: number;
  /** A claim leaves a misfire its job's policy drops, which is then skipped (ClaimOptions.misfireThresholdMs). */
  readonly misfireThresholdMs?: number;
  /** Leader epochs ended by etcd (ClaimOptions.endedEpochs). */
  readonly endedEpochs?: () => EndedEpochsReading | null;
  readonly clock: DbClock;
  readonly metrics: Metrics;
}

/** A claim that found the run not yet due, or a forbid retry blocked, holds it again at most this many times. */
const MAX_REHOLDS = 3;
/** A `forbid` retry blocked by a running sibling is tried again after this (doubling per try). */
const FORBID_WAIT_MS = 500;

/**
 * Claims announced runs in PostgreSQL and decides what a missed claim means. The run queue
 * (run-queue.ts) only decides when to call it; everything that makes a run ours happens here.
 */
export class RunClaimer {
  constructor(private readonly options: RunClaimerOptions) {}

  async claim(message: RunMessage, hold: HoldState): Promise<ClaimOutcome> {
    const result = await this.options.claim({ runId: message.runId, expectedAttempt: message.attempt });
    // Another run of this `forbid` job is running: a fresh occurrence is skipped, a retry waits.
    if (result === 'forbidden') return this.skipOrWait(message, hold);
    if (result === 'missed') return this.afterMiss(message, hold);
    this.options.metrics.runClaims.inc({ source: 'kafka', result: 'claimed' });
    return { kind: 'claimed', run: result };
  }

  /**
   * A claim returned nothing: another worker won (usual), it is not due yet (skew), forbid, or a
   * misfire its job's policy drops (skipped here).
   */
  private async afterMiss(message: RunMessage, hold: HoldState): Promise<ClaimOutcome> {
    const { pool, metrics, skewToleranceMs, claimLeadMs, clock, misfireThresholdMs } = this.options;
    const ended = this.options.endedEpochs?.() ?? null;
    const miss = await explainClaimMiss(pool, message.runId, misfireThresholdMs ?? null, ended);
    const current = miss?.state === 'queued' && miss.attempt === message.attempt - 1;
    if (current && miss.misfired && misfireThresholdMs !== undefined) {
      if (await skipMisfiredRun(pool, message.runId, misfireThresholdMs, ended)) {
        metrics.runsSkipped.inc({ reason: 'misfire' });
        metrics.runClaims.inc({ source: 'kafka', result: 'skipped' });
      }
      return { kind: 'done' };
    }
    if (current && miss.forbidBlocked && miss.dueInMs <= skewToleranceMs) {
      return this.skipOrWait(message, hold);
    }
    if (current && miss.dueInMs > 0 && hold.retries < MAX_REHOLDS) {
      // A forbid or replace run claimed ahead (expected), or our estimate of the database clock
      // is off (then re-sample it): hold again for the database's own figure.
      metrics.runClaims.inc({ source: 'kafka', result: 'early' });
      const explained = hold.early && miss.dueInMs <= claimLeadMs + skewToleranceMs;
      if (!explained) void clock.sync(pool).catch(() => undefined);
      return { kind: 'rehold', notBefore: new Date(clock.now() + miss.dueInMs) };
    }
    metrics.runClaims.inc({ source: 'kafka', result: 'missed' });
    return { kind: 'done' };
  }

  /**
   * A `forbid` run blocked by another run of its job. A fresh occurrence is skipped: that is what
   * `forbid` means. A retry or a replay (attempt > 0) is owed and is never skipped (the SQL of
   * skipRun refuses it too): it is held again and tried after a pause; once the reholds are used
   * up, the polling fallback claims it when the other run has ended.
   */
  private async skipOrWait(message: RunMessage, hold: HoldState): Promise<ClaimOutcome> {
    const { pool, metrics, clock } = this.options;
    if (message.attempt === 1 && (await skipRun(pool, message.runId, 'concurrency-forbid'))) {
      metrics.runsSkipped.inc({ reason: 'concurrency-forbid' });
      metrics.runClaims.inc({ source: 'kafka', result: 'skipped' });
      return { kind: 'done' };
    }
    metrics.runClaims.inc({ source: 'kafka', result: 'waiting' });
    if (message.attempt > 1 && hold.retries < MAX_REHOLDS) {
      return { kind: 'rehold', notBefore: new Date(clock.now() + FORBID_WAIT_MS * 2 ** hold.retries) };
    }
    return { kind: 'done' };
  }
}
