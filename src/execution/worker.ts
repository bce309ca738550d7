import type { Connections } from '../store/pool-share.js';
import type { BrokerClient } from '../broker/index.js';
import { LifecycleError, toError, withTimeout } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { RunLines } from '../observability/run-lines.js';
import type { Metrics } from '../observability/metrics.js';
import type { TargetPolicy } from '../security/target-policy.js';
import type { WorkerConfig } from '../config/index.js';
import type { Notifications } from '../store/notifications.js';
import { inTransaction } from '../store/db.js';
import { claimOverdueRuns } from '../store/overdue.js';
import { HANDOFF_CHANNEL, handOffRuns, peersOrEveryone } from '../store/handoff.js';
import type { RunMessage } from '../model.js';
import type { ClaimedRun, EndedEpochsReading } from '../store/runs.js';
import type { AttemptReport } from '../store/attempts.js';
import { runAttempt, WorkerStoppingError, type AttemptContext } from './attempt.js';
import { watchClaims } from './claim-watch.js';
import {
  completionMayWait,
  createClaimBatcher,
  createCompletionBatcher,
  createFailureBatcher,
  createReleaseBatcher,
  createStartBatcher,
} from './batching.js';
import { DbClock } from './db-clock.js';
import { HttpExecutor } from './http-executor.js';
import { KafkaIntake } from './intake.js';
import { InvalidRunMessageError, parseHandOff } from './run-message.js';
import { pollOverdue } from './poller.js';
import { RunClaimer } from './run-claimer.js';
import { RunQueue } from './run-queue.js';

/** Options of {@link Worker}; node.ts fills them from the config. */
export interface WorkerOptions {
  readonly pool: Connections;
  readonly kafka: BrokerClient;
  readonly notifications: Notifications;
  readonly nodeId: string;
  readonly runsTopic: string;
  readonly deadLetterTopic: string;
  readonly consumerGroup: string;
  /** The worker's tunables (config.worker); `dbConnections` is the node's to apply (the pool share). */
  readonly settings: WorkerConfig;
  /** `stop()` waits this long for in-flight runs before aborting them. */
  readonly drainTimeoutMs: number;
  /** Default: `compileTargetPolicy()`. */
  readonly targetPolicy?: TargetPolicy;
  /**
   * The other live workers' node ids, to address the runs a stopping worker hands over (each to
   * one of them). Default, or when it fails: none known, every worker receives every run.
   */
  readonly handOffPeers?: () => Promise<readonly string[]>;
  /**
   * Which leader epochs have ended, by etcd (EndedEpochs); null or absent: unknown, and the
   * misfire rule knows of ended epochs from the fence alone.
   */
  readonly endedEpochs?: () => EndedEpochsReading | null;
  readonly logger: Logger;
  /** The node's budget of lines about single runs. Default: no limit. */
  readonly runLines?: RunLines;
  readonly metrics: Metrics;
}

type State = 'idle' | 'running' | 'stopping' | 'stopped';

/**
 * How long stop() waits for hand-offs still being sent: within the second the node leaves its
 * worker after the drain (node.ts: drain = shutdown timeout − 1 s).
 */
const HANDOFF_TIMEOUT_MS = 500;

/**
 * The least a poll's statements wait for their answers (see claimOverdue below), whatever the
 * claim grace: a busy database answers a poll after an outage (hundreds of runs) in well under it.
 */
const POLL_READ_TIMEOUT_MIN_MS = 1000;

/**
 * Executes runs on this node (contract items 5–8). Announcements arrive from Kafka and wait in a
 * {@link RunQueue} until due; each is then claimed in PostgreSQL (one conditional UPDATE) and
 * executed only if the claim succeeded. The polling fallback claims runs whose message is late,
 * the claim watch aborts calls whose claim was lost, and `stop()` drains within a deadline.
 */
export class Worker {
  private state: State = 'idle';
  private readonly abort = new AbortController();
  private readonly clock = new DbClock();
  private readonly executor: HttpExecutor;
  private readonly intake: KafkaIntake;
  private readonly queue: RunQueue;
  private readonly loops: Promise<void>[] = [];
  /** The worker's own logger (`part: worker`). */
  private readonly logger: Logger;
  /** Hand-offs being sent while stopping; stop() waits for them (bounded). */
  private readonly handOffs = new Set<Promise<void>>();
  /** Announcements handOff() collects until the event loop's next turn. */
  private readonly handOffWaiting: RunMessage[] = [];
  private unsubscribe?: () => void;
  private starting?: Promise<void>;
  private stopping?: Promise<void>;

  constructor(private readonly options: WorkerOptions) {
    const logger = (this.logger = options.logger.child({ part: 'worker' }));
    this.executor = new HttpExecutor({
      maxExcerptBytes: options.settings.maxExcerptBytes,
      targetPolicy: options.targetPolicy,
    });
    // Successes wait while calls are underway (see createCompletionBatcher).
    const holdMs = options.settings.completionHoldMs;
    // Settle writes wait for their answers only while a retry could still follow within the
    // claim (settleReadTimeoutMs), by this worker's clock estimate.
    const completions = createCompletionBatcher(
      options.pool,
      options.nodeId,
      {
        holdMs,
        callsUnderway: () => this.queue.callsUnderway(),
        writesHeldGrew: () => this.queue.writesHeldGrew(),
      },
      this.clock,
    );
    const writeMayWait = (run: ClaimedRun, report: AttemptReport) =>
      completionMayWait(run, report, this.clock, holdMs);
    const claims = createClaimBatcher(options.pool, this.claimOptions());
    const starts = createStartBatcher(
      options.pool,
      options.nodeId,
      options.settings.skewToleranceMs,
      this.clock,
    );
    const topics = { runsTopic: options.runsTopic, deadLetterTopic: options.deadLetterTopic };
    const failures = createFailureBatcher(options.pool, options.nodeId, topics, this.clock);
    const releases = createReleaseBatcher(options.pool, options.nodeId, topics.runsTopic, this.clock);
    const context: AttemptContext = {
      pool: options.pool,
      nodeId: options.nodeId,
      executor: this.executor,
      topics,
      clock: this.clock,
      start: (run) =>
        starts.add({
          id: run.id,
          attempt: run.attempt,
          answerBy: run.claimExpiresAt.getTime() - run.timeoutMs,
        }),
      complete: (run, report) => completions.add({ run, report }, writeMayWait(run, report)),
      fail: (run, report, retryDelayMs) => failures.add({ run, report, retryDelayMs }),
      release: (run, report, expiryBound) => releases.add({ run, report, expiryBound }),
      writeMayWait,
      handOff: (messages) => this.handOff(messages),
      logger,
      runLines: options.runLines,
      metrics: options.metrics,
    };
    const claimer = new RunClaimer({
      pool: options.pool,
      claim: (request) => claims.add(request),
      skewToleranceMs: options.settings.skewToleranceMs,
      claimLeadMs: options.settings.claimLeadMs,
      misfireThresholdMs: options.settings.misfireThresholdMs,
      endedEpochs: options.endedEpochs,
      clock: this.clock,
      metrics: options.metrics,
    });
    this.queue = new RunQueue({
      claim: (message, hold) => claimer.claim(message, hold),
      claimLeadMs: options.settings.claimLeadMs,
      concurrency: options.settings.concurrency,
      claimGraceMs: options.settings.claimGraceMs,
      prefetch: options.settings.prefetch,
      clock: this.clock,
      run: (run, signal, drainLeftMs, callEnded, untilSlot) =>
        runAttempt(context, run, signal, drainLeftMs, callEnded, untilSlot),
      handOff: (messages) => this.handOff(messages),
      onBackpressure: (full) => (full ? this.intake.pause() : this.intake.resume()),
      writesHeld: () => completions.held,
      onCallsCaughtUp: () => completions.release(),
      logger,
      metrics: options.metrics,
    });
    this.intake = new KafkaIntake({
      kafka: options.kafka,
      topic: options.runsTopic,
      groupId: options.consumerGroup,
      instanceId: options.nodeId,
      logger,
      accept: (message) => this.queue.hold(message),
    });
  }

  /** `idle`, `running`, `stopping` or `stopped`. */
  get status(): State {
    return this.state;
  }

  /**
   * Syncs the clock estimate and starts consuming, polling and watching claims. Joining the
   * consumer group happens in the background (the consumer logs it). A second call returns the
   * first call's promise; a call after `stop()` throws.
   */
  start(): Promise<void> {
    if (this.state === 'stopping' || this.state === 'stopped') {
      return Promise.reject(new LifecycleError(`worker is ${this.state}`));
    }
    this.starting ??= this.startParts();
    return this.starting;
  }

  private async startParts(): Promise<void> {
    this.state = 'running';
    const { options } = this;
    const logger = this.logger;
    await this.clock.sync(options.pool).catch((err: unknown) => {
      logger.warn({ err: toError(err) }, 'cannot read the database clock yet; assuming ours');
    });
    if (this.abort.signal.aborted) return; // stopped while syncing
    const signal = this.abort.signal;
    // What another worker hands over when it stops: held like a Kafka announcement (the claim
    // decides who runs it; a draining queue takes nothing).
    this.unsubscribe = options.notifications.subscribe(HANDOFF_CHANNEL, (payload) => {
      try {
        for (const message of parseHandOff(payload, options.nodeId)) this.queue.hold(message);
      } catch (err) {
        const level = err instanceof InvalidRunMessageError ? 'warn' : 'error';
        logger[level]({ err: toError(err) }, 'dropping an unusable hand-off');
      }
    });
    this.intake.start();
    this.loops.push(
      pollOverdue({
        // A poll answered later than the claim grace after its claim would have them handed back
        // as too late: its statements wait no longer for an answer (a connection gone silent
        // is discarded then, and the next poll takes another), but for its COMMIT, which may
        // commit all the same (see db.ts COMMIT).
        claimOverdue: (overdueMs, limit) =>
          inTransaction(
            options.pool,
            (client) => claimOverdueRuns(client, overdueMs, limit, this.claimOptions()),
            {
              readTimeoutMs: Math.max(options.settings.claimGraceMs, POLL_READ_TIMEOUT_MIN_MS),
            },
          ),
        syncClock: (maxAgeMs) => this.clock.sync(options.pool, maxAgeMs),
        intervalMs: options.settings.pollIntervalMs,
        overdueMs: options.settings.pollOverdueMs,
        capacity: () => this.queue.freeSlots(),
        reserve: (n) => this.queue.reserve(n),
        execute: (runs: ClaimedRun[], inReservedSlots) =>
          runs.forEach((run) => this.queue.execute(run, inReservedSlots)),
        logger: logger.child({ loop: 'poller' }),
        metrics: options.metrics,
        signal,
      }),
      watchClaims({
        pool: options.pool,
        nodeId: options.nodeId,
        notifications: options.notifications,
        claims: () => this.queue.claims(),
        intervalMs: options.settings.claimCheckIntervalMs,
        logger: logger.child({ loop: 'claim-watch' }),
        signal: this.queue.watchSignal,
      }),
    );
    logger.info(
      { concurrency: options.settings.concurrency, clockOffsetMs: Math.round(this.clock.offset) },
      'worker started',
    );
  }

  /**
   * Stops fetching and polling, lets held and in-flight runs finish for `drainTimeoutMs`, then
   * aborts the calls still running and hands their claims back. Safe to call twice.
   */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      const wasRunning = this.state === 'running';
      this.state = 'stopping';
      // A start still syncing the clock sees the abort and starts nothing.
      this.abort.abort();
      await this.starting?.catch(() => undefined);
      const logger = this.logger;
      const failures: Error[] = [];
      const step = async (what: string, work: () => Promise<unknown>) => {
        try {
          await work();
        } catch (err) {
          failures.push(toError(err));
          logger.warn({ err: toError(err) }, `${what} failed during stop`);
        }
      };
      if (wasRunning) {
        this.unsubscribe?.();
        // Fetching stops at once; leaving the group runs alongside the drain.
        const intakeStopped = this.intake.stop();
        await step('draining runs', () =>
          this.queue.drain(this.options.drainTimeoutMs, new WorkerStoppingError('worker is stopping')),
        );
        await step('stopping the Kafka consumer', () => intakeStopped);
        await Promise.all(this.loops);
        this.sendHandOff();
        // Bounded, and not a failure of the stop: a hand-off is a hint, and the other workers'
        // polling fallback claims the runs of one that did not go out (they are still queued).
        await withTimeout(Promise.all(this.handOffs), HANDOFF_TIMEOUT_MS, 'handing runs over').catch(
          (err: unknown) =>
            logger.warn(
              { err: toError(err) },
              'hand-off not sent in time; the other workers poll for those runs',
            ),
        );
      }
      await step('closing HTTP connections', () => this.executor.close());
      this.state = 'stopped';
      if (failures.length > 0) throw new AggregateError(failures, 'worker stopped with errors');
    })();
    return this.stopping;
  }

  /**
   * Sends held or handed-back announcements to the other workers (store/handoff.ts), those of one
   * turn of the event loop together: a stopping worker hands back the runs of a batch of releases
   * at once, and one list of the peers and one statement serve them all, not one each.
   */
  private handOff(messages: RunMessage[]): void {
    if (this.handOffWaiting.length === 0) setImmediate(() => this.sendHandOff());
    // Not push(...messages): a drain may hand over tens of thousands held runs at once.
    for (const message of messages) this.handOffWaiting.push(message);
  }

  /** Sends what handOff() collected; never rejects. */
  private sendHandOff(): void {
    const messages = this.handOffWaiting.splice(0);
    if (messages.length === 0) return;
    const logger = this.logger;
    const list = this.options.handOffPeers ?? (() => Promise.resolve([]));
    const peers = peersOrEveryone(list, (err) =>
      logger.warn({ err: toError(err) }, 'cannot list the other workers; handing runs over to all'),
    );
    const sent: Promise<void> = peers
      .then((to) => handOffRuns(this.options.pool, messages, to))
      .then(
        () => {
          this.options.metrics.runsHandedOff.inc(messages.length);
          logger.info({ runs: messages.length }, 'handed runs over to the other workers');
        },
        (err: unknown) =>
          logger.warn(
            { err: toError(err), runs: messages.length },
            'hand-off failed; the other workers poll for these runs once overdue',
          ),
      );
    this.handOffs.add(sent);
    void sent.finally(() => this.handOffs.delete(sent));
  }

  private claimOptions() {
    return {
      nodeId: this.options.nodeId,
      graceMs: this.options.settings.claimGraceMs,
      skewToleranceMs: this.options.settings.skewToleranceMs,
      leadMs: this.options.settings.claimLeadMs,
      misfireThresholdMs: this.options.settings.misfireThresholdMs,
      endedEpochs: this.options.endedEpochs,
    };
  }
}
