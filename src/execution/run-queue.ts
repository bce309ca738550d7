import { setTimeout as sleep } from 'node:timers/promises';
import Denque from 'denque';
import { ClaimLostError, toError, withTimeout } from '../errors.js';
import type { Logger } from '../observability/logger.js';
import type { Metrics } from '../observability/metrics.js';
import type { RunMessage } from '../model.js';
import type { ClaimedRun } from '../store/runs.js';
import type { DbClock } from './db-clock.js';
import type { ClaimOutcome, HoldState } from './run-claimer.js';

/** Options of {@link RunQueue}. */
export interface RunQueueOptions {
  /** Tries to claim an announced run that is due (RunClaimer.claim in the worker). */
  readonly claim: (message: RunMessage, hold: HoldState) => Promise<ClaimOutcome>;
  /**
   * Claims are tried this long before a run is due, so the round trip is not on the critical
   * path; the call itself waits for not_before (ClaimOptions.leadMs must be the same).
   */
  readonly claimLeadMs: number;
  /**
   * Calls in progress at once (execution slots). A run whose call has ended gives its slot back
   * while its outcome is written, up to as many such runs again (see {@link RunQueue}). Claims do
   * not take a slot: a run is claimed ahead and takes one when it is due.
   */
  readonly concurrency: number;
  /**
   * A claim's deadline is its run's not_before + timeout + this (ClaimOptions.graceMs): a run
   * claimed ahead must get its slot within it, so runs are claimed ahead of free slots only as
   * many as the slots can start within half of it at their recent pace.
   */
  readonly claimGraceMs: number;
  /** Announcements held (waiting for their time or a slot) before back-pressure applies. */
  readonly prefetch: number;
  readonly clock: DbClock;
  /**
   * Executes a claimed run; `signal` aborts the call. `drainLeftMs` says, when called, the time
   * left before a drain aborts what still runs (Infinity while the queue is not draining), so a
   * call that could not end by then must not start (attempt.ts hands its claim back instead). `callEnded` is called once
   * the call has ended (or will not be made) and only its outcome is left to write, with
   * `writeMayWait` when that write may be held back (`writesHeld`). `untilSlot` resolves once the
   * run holds an execution slot (or at once when `signal` aborts): run() awaits it before the call.
   * A run claimed ahead (startPending) is given to run() before its slot, to be marked started
   * meanwhile; any other already holds its slot. Must not reject.
   */
  readonly run: (
    run: ClaimedRun,
    signal: AbortSignal,
    drainLeftMs: (() => number) | undefined,
    callEnded: (called?: boolean, writeMayWait?: boolean) => void,
    untilSlot: () => Promise<void>,
  ) => Promise<void>;
  /**
   * Given, while draining, the held announcements this queue leaves uncalled (due after the drain
   * deadline, or whose call could not end before it), for the other workers to take at once.
   * Default: nothing (they are claimed by the others' polling fallback once overdue).
   */
  readonly handOff?: (messages: RunMessage[]) => void;
  /** Called with true when fetching should pause (prefetch full), false when it may resume. */
  readonly onBackpressure: (full: boolean) => void;
  /**
   * Outcomes whose write is being held back while calls are underway (the completion batcher's
   * `held`): their runs give their slots back however many they are (see busy()). Default: none.
   */
  readonly writesHeld?: () => number;
  /**
   * Called whenever the queue has been updated and no call is underway ({@link RunQueue.callsUnderway}
   * is false): held writes may go. Level-triggered (runs join and leave the slot queue between
   * updates), so it must be cheap when nothing is held.
   */
  readonly onCallsCaughtUp?: () => void;
  readonly logger: Logger;
  readonly metrics: Metrics;
}

interface Held {
  readonly message: RunMessage;
  /** The instant (database clock, ms) of the wake-up it waits for, if it waits for one. */
  wakeAt?: number;
  /** Times a claim found the run not yet due (clock skew) and held it again. */
  readonly retries: number;
  /** Claim ahead of time (false once a claim ahead was refused: forbid and replace runs). */
  readonly early: boolean;
}

interface Execution {
  readonly runId: string;
  /** The attempt this execution was started for (the announcement's, or the poller's claim). */
  readonly announced: number;
  /** 0 until the claim returned. */
  attempt: number;
  readonly controller: AbortController;
  done?: Promise<void>;
  /** Set when the claim found the run not yet due: held again once this execution is gone. */
  rehold?: { message: RunMessage; retries: number };
  /** Its call has ended (or will not be made); only the outcome's write is left. */
  settling?: boolean;
  /**
   * Claimed ahead and not yet marked started: START, before its call, checks its claim (a
   * withdrawn, deleted or taken-over run is not started), so the claim watch leaves it out.
   */
  startPending?: boolean;
  /**
   * Holds an execution slot (see {@link RunQueue}): from when it was given one (a claimed run once
   * due; the poller's runs at once, in the slots it reserved) until the execution has ended.
   */
  slotted: boolean;
  /** performance.now() when it got its slot: the call time estimate's sample starts there. */
  slotAt: number;
  /** Holds a start pass (see START_PASSES_PER_SLOT) until it has its slot or has ended. */
  startPass?: boolean;
  /** Its call ended past `concurrency` settling runs: it keeps its slot until written. */
  keptSlot?: boolean;
  /**
   * Claimed or given its slot during a backlog (see `RunQueue.backlog`), and its call has not
   * ended: such as a herd's calls (see {@link RunQueue.callsUnderway}).
   */
  backlogCall?: boolean;
  /**
   * Ends the wait it is in, for its instant or for a slot, when its controller aborts: one abort
   * listener per execution calls it, instead of one added and removed per wait (each pair ≈3 µs
   * of a herd's CPU per run).
   */
  stopWaiting?: () => void;
  /**
   * Claimed ahead, or being claimed: the earliest its call could end, its not_before plus its
   * timeout (database clock, ms; the announcement's until the claim returns). See drain().
   */
  callEndsBy?: number;
}

/** Held runs waiting for the same instant: one timer for all of them (a herd: thousands, one timer). */
interface Wakeup extends InstantTimer {
  readonly entries: Set<Held>;
}

/**
 * Claimed runs waiting for the same not_before: one timer for all of them, as {@link Wakeup} is for
 * held runs. A herd's thousands of runs claimed ahead wake in one callback, in the order they
 * were claimed, instead of one promise timer and abort listener each (24–70 µs of CPU per run
 * measured for `timers/promises` with a signal, against 1–3 µs this way).
 */
interface DueWait extends InstantTimer {
  /** Resolvers of the runs waiting, each also resolved on its own when its execution is aborted. */
  readonly waiters: Set<() => void>;
}

/** A claimed, due run waiting for a slot; `grant` gives it one. */
interface SlotWaiter {
  readonly execution: Execution;
  /** `waitedForCall`: the slot is one a call (or a held write) gave back, not a reservation. */
  readonly grant: (waitedForCall: boolean) => void;
}

/**
 * Start passes: a run claimed ahead is marked started (START, batched with the other runs' STARTs
 * into statements of up to 256 runs) when it is due, before its call. Marked only once it had its
 * slot, a herd's STARTs went as the slots freed, a few runs per statement (≈185 statements per
 * node for 3,300 runs, each a round trip the call waited for). So a due run takes a start pass, is
 * marked started while it waits for its slot, and gives the pass back when it gets the slot. The
 * passes are given out in blocks: once no more than half of them are held, the runs waiting for
 * one get passes up to the limit together, and their STARTs go in a few full statements while the
 * runs already marked take the slots. At most {@link startPasses} runs of a worker are marked
 * started without a call: a worker that dies leaves those to the reaper at their claims' deadline,
 * as it leaves its calls in flight (runs claimed ahead and not marked are taken back sooner,
 * HELIOS_CLAIM_GRACE_MS after they fell due). Waiters are served first come first served, and every
 * claimed run waits for a pass, marked or not: when only runs claimed ahead took passes, runs
 * claimed once due went straight to the slots, ahead of those still waiting for a pass; under a
 * backlog (offered 4,000 runs/s on the benchmark's 3 nodes) runs claimed ahead then waited past
 * their claims' grace and were handed back by the block of 512 (`claim-too-late`), and the
 * throughput fell from 4,000 to ≈3,000 runs/s.
 */
const START_PASSES_PER_SLOT = 8;
/** Two full START statements (MAX_BATCH, batching.ts). */
const START_PASSES_MAX = 512;

/** Start passes of a worker with `concurrency` slots (see START_PASSES_PER_SLOT). */
export const startPasses = (concurrency: number): number =>
  Math.min(concurrency * START_PASSES_PER_SLOT, START_PASSES_MAX);

/** `untilSlot` for a run that holds its slot already. */
const slotHeld = (): Promise<void> => Promise.resolve();

/** Removes the first `item` from `queue`, if it is there (a scan: for the rare removal from the middle). */
function removeFrom<T>(queue: Denque<T>, item: T): void {
  for (let i = 0; i < queue.length; i++) {
    if (queue.peekAt(i) === item) {
      queue.removeOne(i);
      return;
    }
  }
}

/** Longest setTimeout Node accepts; a longer hold re-arms. */
const MAX_TIMER_MS = 2_147_483_647;

/** A timer shared by everything that waits for one instant ({@link Wakeup}, {@link DueWait}). */
interface InstantTimer {
  timer: NodeJS.Timeout;
  /** performance.now() when the timer fires. */
  firesAt: number;
}

/** A timer calling `fire` in `delayMs`, rounded up: a timer never fires before its time. */
function startTimer(delayMs: number, fire: () => void): InstantTimer {
  const waitMs = Math.min(MAX_TIMER_MS, Math.ceil(delayMs));
  return { timer: setTimeout(fire, waitMs), firesAt: performance.now() + waitMs };
}

/** Replaces `shared`'s timer with one calling `fire` in `delayMs` (see startTimer). */
function rearm(shared: InstantTimer, delayMs: number, fire: () => void): void {
  clearTimeout(shared.timer);
  Object.assign(shared, startTimer(delayMs, fire));
}

/**
 * The shared timer of instant `at` in `timers`, made by `create` around a new timer when there is
 * none. An existing one is armed again when it would fire later than `delayMs` from now: the clock
 * estimate moved forward since it was set (a re-sync), so by it the instant comes sooner, for
 * everything already waiting for it too.
 */
function timerOf<T extends InstantTimer>(
  timers: Map<number, T>,
  at: number,
  delayMs: number,
  fire: () => void,
  create: (started: InstantTimer) => T,
): T {
  const shared = timers.get(at);
  if (!shared) {
    const created = create(startTimer(delayMs, fire));
    timers.set(at, created);
    return created;
  }
  if (performance.now() + Math.min(MAX_TIMER_MS, Math.ceil(delayMs)) < shared.firesAt - 1) {
    rearm(shared, delayMs, fire);
  }
  return shared;
}

/**
 * The call time (slot to call end) assumed before this node has timed a call: a typical webhook.
 * Its first timed calls replace it (see sampleSlot).
 */
const INITIAL_CALL_MS = 50;
/** Weight of each new call in the call time estimate (an exponential moving average). */
const CALL_MS_WEIGHT = 0.05;
/** How long slots given to waiting runs are counted before they make one sample of the pace. */
const PACE_WINDOW_MS = 250;
/** Weight of each window in the measured pace (an exponential moving average). */
const PACE_WEIGHT = 0.3;

/**
 * The worker's in-memory timing and execution slots, with no database of its own (unit-tested
 * with fakes): the claim is a function it is given (run-claimer.ts).
 * The pipeline: held announcements (until `claimLeadMs` before not_before by the database
 * clock; one timer per instant, shared by every run held for it) → ready → claimed (batched by
 * the claimer, no slot) → at not_before, a slot → the call (at most `concurrency` at once). Only the claim in PostgreSQL makes a run ours; this
 * queue only decides *when* to try, so losing it (a crash) loses nothing but time: the polling
 * fallback claims what was held here, the reaper what was claimed.
 *
 * Claims run ahead of the slots: a herd's claims are made in large statements before it is due,
 * not one small statement per freed slot after it (their round trips and per-statement CPU were
 * on the herd's critical path). How far ahead is bounded by the claim's deadline: a claimed run
 * must get its slot within `claimGraceMs` of not_before, or it is handed back unstarted
 * (attempt.ts, `claim-too-late`). So beyond the free slots, only as many runs are claimed ahead
 * as the slots start in half that time at their recent pace (Little's law: `concurrency` slots
 * held `callMs` each start `concurrency / callMs` runs per ms). With targets that answer in
 * seconds this is about nothing, and a run is claimed only when a slot is free for it, as before.
 * While runs wait for slots the node is saturated (short of CPU, or its database is), and then
 * the pace at which slots were really given bounds the claims ahead too: the call time sampled
 * under such load swings, and claims made at a low sample waited past their grace.
 *
 * A slot is given back when the call ends, not when its outcome is written: under load the next
 * run's claim and call no longer wait for that write's round trip (lateness). At most
 * `concurrency` runs settle this way at once; past that a settling run keeps its slot until one
 * is written, so a slow database slows the intake instead of piling up finished calls. An
 * execution stays in `executing` until written, so a drain, `hold` and the claim watch see it as
 * before.
 */
export class RunQueue {
  private readonly held = new Map<string, Held>();
  /** Held runs by the instant they wait for (database clock, ms); see {@link Wakeup}. */
  private readonly wakeups = new Map<number, Wakeup>();
  /** Claimed runs by the not_before they wait for (database clock, ms); see {@link DueWait}. */
  private readonly dueWaits = new Map<number, DueWait>();
  /**
   * Held runs whose time has come, waiting for the claim budget. Double-ended queues, as
   * `slotWaiters` is: a herd's thousands leave from the front one by one, and an array's shift()
   * copies the rest once its backing store is too large for V8 to trim in place (past ≈16,000
   * entries): a 20,000-run herd on one node spent 670 ms of CPU in those copies.
   */
  private readonly ready = new Denque<string>();
  private readonly executing = new Map<string, Execution>();
  /**
   * Executions whose entry in `executing` the poller's claim of the same run replaced: aborted
   * (their claim is gone), but counted (slot, settling, drain) until they have ended.
   */
  private readonly superseded = new Set<Execution>();
  private reserved = 0;
  /** Executions holding a slot (in `executing` or `superseded`). */
  private slotted = 0;
  /** Executions claiming or claimed without a slot yet (waiting for not_before or a slot). */
  private ahead = 0;
  /** Claimed, due runs waiting for a slot, first come first served. */
  private readonly slotWaiters = new Denque<SlotWaiter>();
  /** Executions holding a start pass (see START_PASSES_PER_SLOT). */
  private startPassesHeld = 0;
  /** Claimed, due runs still to be marked started, waiting for a start pass, first come first served. */
  private readonly startPassWaiters = new Denque<() => void>();
  /** Recent time a slot was held until the call ended, ms (see RunQueue). */
  private callMs: number;
  /** Calls timed so far, up to 1 / CALL_MS_WEIGHT (the estimate is their mean until then). */
  private callsTimed = 0;
  /**
   * Slots given per ms while runs waited for one: what this node really starts when its slots are
   * not what holds it back (its CPU or the database is). Undefined while it has slots to spare.
   */
  private saturatedPace?: number;
  /** The current pace window: since when, slots given to waiting runs in it, waiting at its start. */
  private readonly paceWindow = { since: performance.now(), granted: 0, waitedAtStart: false };
  /** Executions whose call has ended and whose outcome is being written (see callEnded()). */
  private settling = 0;
  /** Executions whose `backlogCall` is set. */
  private backlogCalls = 0;
  /**
   * A backlog is on: runs were left waiting for calls (for the claim budget, or for a slot that a
   * call holds, not the poller's reservation: see callsFillSlots()), and its calls have not all
   * ended. Every run claimed or given a slot meanwhile is part of it (`backlogCall`), those claimed
   * from `ready` from their claim on, so the writes held for a herd do not go while its last
   * claims are on their way or its last calls are underway. Set at the end of pump(), when a run
   * is left waiting for a slot, and when a run that waited gets the slot of a call that ended
   * (giveSlot); never by the claims in the middle of a pump (the runs one pump claims together did
   * not wait for each other). Cleared by update().
   */
  private backlog = false;
  /** In the pump of a reservation's release: the slots it gives out were held by no call. */
  private releasing = false;
  private full = false;
  private draining = false;
  /**
   * While draining: the time left before calls still running are aborted. Monotonic, like the
   * drain's own timer: a re-sync of the database clock estimate during the drain must not move it.
   */
  private drainLeftMs?: () => number;
  /**
   * What run() is given as its `drainLeftMs`: read when the call is about to begin (after START),
   * not when run() is called, so a drain that begins in between applies to the call. Read when
   * run() was called, a drain beginning while a run's START was on its way let a call start that
   * the drain then cut at its deadline, and the worker it was handed to called the run again.
   */
  private readonly drainLeftNow = (): number => this.drainLeftMs?.() ?? Infinity;
  /** Set once the drain is over: a run the poller claims after that is handed back, not called. */
  private drainedWith?: Error;
  private readonly watch = new AbortController();
  private onIdle?: () => void;

  constructor(private readonly options: RunQueueOptions) {
    // Before this node has timed a call it guesses. Too low a guess (slow targets) costs claims
    // handed back uncalled, at no cost of an attempt, from its first herd only: the first calls
    // timed replace the guess (sampleSlot). Too high a guess kept a fresh node from claiming a
    // herd before it was due (0.6 s more for the bench's herd with half the grace as the guess).
    this.callMs = INITIAL_CALL_MS;
    options.metrics.trackWorkerQueue(() => ({
      held: this.held.size,
      inFlight: this.slotted - this.settling,
      settling: this.settling,
      completionsHeld: Math.min(this.options.writesHeld?.() ?? 0, this.settling),
      claimedAhead: this.ahead,
    }));
  }

  /** Aborted once the queue has drained: the claim watch runs until then. */
  get watchSignal(): AbortSignal {
    return this.watch.signal;
  }

  /** Takes an announcement from Kafka: held until due, then claimed. Never blocks. */
  hold(message: RunMessage, retries = 0, early = true): void {
    if (this.draining) return;
    const execution = this.executing.get(message.runId);
    if (execution) {
      // A retry is announced by the very transaction that settles the attempt before it, so its
      // message can arrive while that execution is still winding down: keep it for afterwards.
      // Dropping it left the retry to the polling fallback, seconds late.
      if (message.attempt > Math.max(execution.announced, execution.rehold?.message.attempt ?? 0)) {
        execution.rehold = { message, retries };
      }
      return;
    }
    const existing = this.held.get(message.runId);
    // The same announcement twice (re-delivery, or the relay re-publishing) is held once.
    if (existing && existing.message.attempt >= message.attempt) return;
    if (existing) this.forget(message.runId);
    // Only `allow` runs are claimed ahead (store/runs.ts); a policy the message names otherwise is
    // held for its time rather than refused first.
    const entry: Held = { message, retries, early: early && (message.concurrency ?? 'allow') === 'allow' };
    this.held.set(message.runId, entry);
    this.arm(entry);
    this.update();
  }

  /** Slots the polling fallback may claim now. */
  freeSlots(): number {
    if (this.draining) return 0;
    return Math.max(0, this.options.concurrency - this.busy() - this.ahead - this.ready.length);
  }

  /** Reserves `n` slots; the returned function gives them back (once). */
  reserve(n: number): () => void {
    this.reserved += n;
    let released = false;
    return () => {
      if (released) return;
      released = true;
      this.reserved -= n;
      this.releasing = true;
      try {
        this.pump();
      } finally {
        this.releasing = false;
      }
      this.checkIdle();
    };
  }

  /**
   * Executes a run claimed elsewhere (the poller): in a slot the caller reserved, or, when
   * `inReservedSlot` is false (the poll's reservation lapsed before its claims came back), after
   * a start pass and a slot, as a run claimed from an announcement.
   */
  execute(run: ClaimedRun, inReservedSlot = true): void {
    this.forget(run.id);
    this.track(run.id, run.attempt, inReservedSlot, async (execution) => {
      // A poll whose claims came back after the drain ended: nothing would abort the call any
      // more, and the executor is closed next. Called with the stop reason, it hands them back.
      if (this.drainedWith) execution.controller.abort(this.drainedWith);
      if (!inReservedSlot) return this.runClaimed(run, execution);
      execution.attempt = run.attempt;
      await this.options.run(
        run,
        execution.controller.signal,
        this.drainLeftNow,
        (called, writeMayWait) => this.callEnded(execution, called, writeMayWait),
        slotHeld,
      );
    });
  }

  /**
   * Claims for the claim watch: those being executed, and those waiting for their time or a slot
   * unless their START is still to come. A run claimed ahead is checked by its START (leaving the
   * thousands a herd or a second of steady load claims ahead out of every check: at 2,000 runs/s
   * with a 1 s lead, the default then, the watch's statement cost ≈50 µs per run); from its start
   * pass on (START on its way or done, at most startPasses() of them) it is watched: a delete or a
   * takeover after its START ends its wait for a slot. Not those settling: their call is over, so
   * there is nothing left to abort, and their write is conditional on the claim (a herd's writes
   * held back while calls wait are thousands).
   */
  *claims(): Iterable<{ runId: string; attempt: number; controller: AbortController }> {
    for (const execution of this.executing.values())
      if (
        execution.attempt > 0 &&
        !execution.settling &&
        (execution.slotted || execution.startPass || !execution.startPending)
      )
        yield execution;
  }

  /**
   * Stops taking work; waits up to `timeoutMs` for held runs due within that time and for calls in
   * flight; then hands what is still held to the other workers (`handOff`; their polling fallback
   * claims it once overdue if that hint is lost) and aborts the calls with `reason`. Ends the claim
   * watch.
   *
   * A held run that falls due meanwhile is claimed and called only if its call can end (its
   * timeout) before the deadline: a call the drain itself started and then aborted may already have
   * reached the target, and its run would be called again elsewhere (seen in the rolling restart,
   * a run due a few ms before the deadline). Only calls in flight when the drain began can be cut.
   */
  async drain(timeoutMs: number, reason: Error): Promise<void> {
    this.draining = true;
    const deadline = this.options.clock.now() + timeoutMs;
    const abortAt = performance.now() + timeoutMs;
    // None once the deadline has passed: the timer that ends the wait can fire up to a millisecond
    // before abortAt by performance.now() (timers run on the event loop's cached, whole-ms clock).
    this.drainLeftMs = () => (this.drainedWith ? 0 : abortAt - performance.now());
    // Handed to the other workers, unclaimed: what falls due after the deadline, and what could not
    // end before it (its announced timeout). Claiming those only to hand them back would cost each
    // an attempt number and two writes.
    const left: RunMessage[] = [];
    for (const [runId, { message }] of this.held) {
      if (message.notBefore.getTime() + (message.timeoutMs ?? 0) >= deadline) {
        left.push(message);
        this.forget(runId);
      }
    }
    if (left.length > 0) this.options.handOff?.(left);
    // The same for runs claimed ahead (or being claimed) that have no slot yet: aborted now, they
    // hand their claims back together (batched) and the other workers get them before they are
    // due, instead of each being handed back alone when it falls due and gets a slot. A worker
    // stopped just before a herd held 3,300 such runs; handed back one by one as they fell due,
    // 2,000 were still claimed when its drain ended, and ran only once their claims expired.
    for (const execution of this.executing.values()) {
      if (!execution.slotted && (execution.callEndsBy ?? -Infinity) >= deadline) {
        execution.controller.abort(reason);
      }
    }
    this.update();
    const idle = new Promise<void>((resolve) => (this.onIdle = resolve));
    this.checkIdle();
    const timer = new AbortController();
    await Promise.race([idle, sleep(timeoutMs, undefined, { signal: timer.signal }).catch(() => undefined)]);
    timer.abort();
    const dropped = this.held.size;
    if (dropped > 0) this.options.handOff?.([...this.held.values()].map((entry) => entry.message));
    for (const runId of [...this.held.keys()]) this.forget(runId);
    this.update();
    const running = [...this.executing.values(), ...this.superseded];
    // Settling executions' calls are over: only their writes are waited for. Claimed runs without
    // a slot have not called: aborted, they hand their claims back.
    const calling = running.filter((execution) => execution.slotted && !execution.settling).length;
    if (dropped > 0 || calling > 0) {
      this.options.logger.warn({ dropped, aborted: calling }, 'drain deadline passed');
    }
    for (const execution of running) execution.controller.abort(reason);
    this.drainedWith = reason;
    // Each aborted call hands its claim back; bounded, so a database outage cannot hang stop.
    await withTimeout(
      Promise.allSettled(running.map((e) => e.done)),
      5_000,
      'handing back aborted claims',
    ).catch(() => undefined);
    this.watch.abort();
  }

  /**
   * Calls are underway: due runs wait for the claim budget or a slot, or runs claimed or given a
   * slot during that backlog have not ended their calls (START, the call): a herd until its last
   * call has ended. A call that got its slot with no backlog on (a long call beside a light load)
   * does not count: writes held back for it would buy no other call its CPU, and would widen the
   * window in which a crash makes a finished call again. Not while draining: what is left of the
   * drain should not wait for writes held back meanwhile.
   */
  callsUnderway(): boolean {
    return !this.draining && (this.ready.length > 0 || this.waitingForCalls() || this.backlogCalls > 0);
  }

  /** Due runs wait for a slot or a start pass (which slots give back). */
  private waitingForCalls(): boolean {
    return this.slotWaiters.length > 0 || this.startPassWaiters.length > 0;
  }

  /**
   * Slots taken: calls, and the settling runs beyond `concurrency` of them (writes held back while
   * calls are underway, `writesHeld`, never take one), and reservations.
   */
  private busy(): number {
    return this.slotted - this.settlingWithoutSlot() + this.reserved;
  }

  /** More writes are held (`writesHeld`): their runs' slots are free now, for runs waiting for one. */
  writesHeldGrew(): void {
    this.pump();
  }

  /** Settling runs that have given their slot back: those whose write is held, and `concurrency` more. */
  private settlingWithoutSlot(): number {
    const held = Math.min(this.options.writesHeld?.() ?? 0, this.settling);
    return held + Math.min(Math.max(0, this.settling - held), this.options.concurrency);
  }

  /**
   * Runs that may be claiming or claimed without a slot: one per free slot, and beyond those as
   * many as the slots start within half the claim grace: at the recent call time (see RunQueue),
   * and while runs wait for slots, at most at the pace slots were really given to them.
   */
  private claimBudget(withoutReservation = false): number {
    const { concurrency, claimGraceMs, prefetch } = this.options;
    const free = Math.max(0, concurrency - this.busy() + (withoutReservation ? this.reserved : 0));
    // A stopping worker claims only for its free slots: a run claimed ahead would be handed back.
    if (this.draining) return free;
    const bySlots = (concurrency * claimGraceMs) / 2 / Math.max(1, this.callMs);
    // Little's law counts on the slots being what limits the pace. A node short of CPU starts
    // fewer runs than its slots would, and the call time it samples swings with its load: claims
    // made at a low sample waited past their grace and were handed back (a node offered more than
    // it can run claimed 4,000 runs ahead at a pace of 900 a second, and one in ten went back).
    const byPace = this.saturatedPace === undefined ? Infinity : (this.saturatedPace * claimGraceMs) / 2;
    return free + Math.floor(Math.min(bySlots, byPace, prefetch));
  }

  /**
   * Samples the pace at which waiting runs got slots, in windows of PACE_WINDOW_MS during which
   * runs waited throughout (from before the window until after it), for a slot or for a start
   * pass (which runs give back as they get slots). Once none waits, slots are to spare and the
   * call time alone bounds the claims ahead again.
   */
  private measurePace(): void {
    const now = performance.now();
    const window = this.paceWindow;
    const waiting = this.waitingForCalls();
    if (!waiting) this.saturatedPace = undefined;
    else if (now - window.since < PACE_WINDOW_MS) return;
    else if (window.waitedAtStart) {
      const pace = window.granted / (now - window.since);
      const before = this.saturatedPace ?? pace;
      this.saturatedPace = before + (pace - before) * PACE_WEIGHT;
    }
    // Reset in place: while no run waits this runs on every pump.
    window.since = now;
    window.granted = 0;
    window.waitedAtStart = waiting;
  }

  /**
   * The execution's call is over: its slot goes to the next claimed run (see busy()). Nothing for
   * an execution without a slot (aborted before it got one: it made no call).
   */
  private callEnded(execution: Execution, called = true, writeMayWait = false): void {
    if (!execution.slotted || execution.settling || !this.isTracked(execution)) return;
    execution.settling = true;
    this.settling += 1;
    this.endBacklogCall(execution);
    // Only a call made measures how long calls hold their slots: one not made (handed back, or
    // aborted before it started) took ~0 ms and would raise the budget that made it late.
    // A write about to be held gives its slot back however many settle: sampled now, or the hold
    // would count as call time.
    if (called && (writeMayWait || this.settling <= this.settlingWithoutSlot())) this.sampleSlot(execution);
    else if (called) execution.keptSlot = true;
    this.pump();
  }

  /**
   * Resolves once the execution holds a slot, or at once when `signal` aborts (the claim was lost
   * or the worker is stopping: the run is then handed back or dropped without a call).
   */
  private slotFor(execution: Execution, signal: AbortSignal): Promise<void> {
    if (execution.slotted || signal.aborted) return Promise.resolve();
    if (this.slotWaiters.length === 0 && this.busy() < this.options.concurrency) {
      this.giveSlot(execution);
      // Counted in the pace as a slot pump() gives (measurePace keeps the count only for windows in
      // which runs waited throughout): a block of runs whose STARTs come back together takes the
      // free slots here. Uncounted, a window in which every slot went this way measured no pace at
      // all while runs waited for passes, and the claims ahead stopped at the free slots.
      this.paceWindow.granted += 1;
      return Promise.resolve();
    }
    return new Promise<void>((resolve) => {
      const waiter: SlotWaiter = {
        execution,
        grant: (waitedForCall) => {
          execution.stopWaiting = undefined;
          this.giveSlot(execution, waitedForCall);
          resolve();
        },
      };
      execution.stopWaiting = () => {
        execution.stopWaiting = undefined;
        removeFrom(this.slotWaiters, waiter);
        resolve();
      };
      this.slotWaiters.push(waiter);
      // Left waiting for a slot by calls, outside pump(): a backlog (see `backlog`).
      if (this.callsFillSlots()) this.backlog = true;
    });
  }

  /**
   * Resolves once the execution holds a start pass (see START_PASSES_PER_SLOT), or at once when
   * `signal` aborts (the run is then handed back or dropped without a call).
   */
  private startPassFor(execution: Execution, signal: AbortSignal): Promise<void> {
    if (signal.aborted) return Promise.resolve();
    if (this.startPassWaiters.length === 0 && this.startPassesHeld < startPasses(this.options.concurrency)) {
      this.takeStartPass(execution);
      return Promise.resolve();
    }
    return new Promise<void>((resolve) => {
      const grant = () => {
        execution.stopWaiting = undefined;
        this.takeStartPass(execution);
        resolve();
      };
      execution.stopWaiting = () => {
        execution.stopWaiting = undefined;
        removeFrom(this.startPassWaiters, grant);
        resolve();
      };
      this.startPassWaiters.push(grant);
      // Waiting for passes that runs waiting for slots hold: a backlog (see `backlog`).
      if (this.callsFillSlots()) this.backlog = true;
    });
  }

  private takeStartPass(execution: Execution): void {
    execution.startPass = true;
    this.startPassesHeld += 1;
  }

  /**
   * The execution got its slot or has ended: its start pass is free. Once no more than half of
   * the passes are held, the runs waiting for one get passes up to the limit together (a block).
   */
  private returnStartPass(execution: Execution): void {
    if (!execution.startPass) return;
    execution.startPass = false;
    this.startPassesHeld -= 1;
    const passes = startPasses(this.options.concurrency);
    if (this.startPassesHeld > passes / 2) return;
    while (this.startPassWaiters.length > 0 && this.startPassesHeld < passes)
      this.startPassWaiters.shift()!();
  }

  /**
   * Every slot is taken by an execution, not by the poller's reservation: a run that waits for a
   * slot now waits for a call to end. A run that waits only while the poller's query holds the
   * slots reserved (a few ms) waits for no call, and is no backlog: holding writes back for it
   * would buy no call its CPU.
   */
  private callsFillSlots(): boolean {
    return this.busy() - this.reserved >= this.options.concurrency;
  }

  /**
   * Runs wait in `ready` for the claim budget, and would without the poller's reservation too: the
   * calls underway (and the claims ahead they allow) are what holds them back, as callsFillSlots()
   * for the slots.
   */
  private readyWaitsForCalls(): boolean {
    return this.ready.length > 0 && this.ahead + this.ready.length > this.claimBudget(true);
  }

  /**
   * A run given a slot during a backlog (see `backlog`) or while runs wait for the claim budget is
   * part of it ({@link Execution.backlogCall}). One that waited and got the slot of a call that
   * ended (`waitedForCall`) starts a backlog, though it began waiting while the poller's query held
   * a slot reserved: it waited for that call.
   */
  private giveSlot(execution: Execution, waitedForCall = false): void {
    execution.slotted = true;
    execution.slotAt = performance.now();
    this.ahead -= 1;
    this.slotted += 1;
    this.returnStartPass(execution);
    if (waitedForCall) this.backlog = true;
    if (this.backlog || this.readyWaitsForCalls()) this.startBacklogCall(execution);
  }

  private startBacklogCall(execution: Execution): void {
    if (execution.backlogCall) return;
    execution.backlogCall = true;
    this.backlogCalls += 1;
  }

  private endBacklogCall(execution: Execution): void {
    if (!execution.backlogCall) return;
    execution.backlogCall = false;
    this.backlogCalls -= 1;
  }

  /**
   * How long the execution held its slot: until its call ended, or its write when it kept it. The
   * estimate is the mean of the calls timed so far, then a moving average once there are enough.
   */
  private sampleSlot(execution: Execution): void {
    if (this.callsTimed < 1 / CALL_MS_WEIGHT) this.callsTimed += 1;
    const weight = Math.max(CALL_MS_WEIGHT, 1 / this.callsTimed);
    this.callMs += (performance.now() - execution.slotAt - this.callMs) * weight;
  }

  private isTracked(execution: Execution): boolean {
    return this.executing.get(execution.runId) === execution || this.superseded.has(execution);
  }

  /** Marks the entry ready when its time has come, or adds it to the wake-up of its instant. */
  private arm(entry: Held): void {
    if (this.armOnly(entry)) this.pump();
  }

  /** arm() without the pump: true when the entry is ready now. */
  private armOnly(entry: Held): boolean {
    const lead = entry.early ? this.options.claimLeadMs : 0;
    const at = entry.message.notBefore.getTime() - lead;
    const delayMs = at - this.options.clock.now();
    if (delayMs <= 0) {
      this.ready.push(entry.message.runId);
      return true;
    }
    // A timer never fires before its time, but the event loop's cached clock can make it a
    // little early (wake() holds such entries again); the claim's skew tolerance absorbs the rest.
    const wakeup = timerOf(
      this.wakeups,
      at,
      delayMs,
      () => this.wake(at),
      (shared) => ({ ...shared, entries: new Set<Held>() }),
    );
    wakeup.entries.add(entry);
    entry.wakeAt = at;
    return false;
  }

  /**
   * The instant `at` has come: its runs are ready (or wait again: a timer cut at MAX_TIMER_MS, or
   * a re-sync of the clock estimate that moved the instant later), then one pump for all of them.
   */
  private wake(at: number): void {
    const wakeup = this.wakeups.get(at);
    if (!wakeup) return;
    this.wakeups.delete(at);
    for (const entry of wakeup.entries) {
      entry.wakeAt = undefined;
      // Only the entry held for its run now (forget() removes the others; kept as a guard).
      if (this.held.get(entry.message.runId) === entry) this.armOnly(entry);
    }
    this.pump();
  }

  /**
   * Removes a held announcement (and its place in its wake-up). The caller calls update() once its
   * change is complete: back-pressure released here could deliver a message (hold()) in the middle
   * of it.
   */
  private forget(runId: string): void {
    const entry = this.held.get(runId);
    if (!entry) return;
    this.held.delete(runId);
    if (entry.wakeAt !== undefined) {
      const wakeup = this.wakeups.get(entry.wakeAt);
      wakeup?.entries.delete(entry);
      if (wakeup?.entries.size === 0) {
        clearTimeout(wakeup.timer);
        this.wakeups.delete(entry.wakeAt);
      }
      entry.wakeAt = undefined;
    } else {
      removeFrom(this.ready, runId);
    }
  }

  /** Gives free slots to claimed runs that are due, then claims ready runs within the budget. */
  private pump(): void {
    while (this.slotWaiters.length > 0 && this.busy() < this.options.concurrency) {
      this.slotWaiters.shift()!.grant(!this.releasing);
      this.paceWindow.granted += 1;
    }
    this.measurePace();
    while (this.ready.length > 0 && this.ahead < this.claimBudget()) {
      const runId = this.ready.shift()!;
      const entry = this.held.get(runId);
      if (!entry) continue;
      this.held.delete(runId);
      this.track(runId, entry.message.attempt, false, (execution) => this.claimAndRun(entry, execution));
    }
    if (this.readyWaitsForCalls() || (this.waitingForCalls() && this.callsFillSlots())) this.backlog = true;
    this.update();
  }

  private track(
    runId: string,
    announced: number,
    slotted: boolean,
    work: (execution: Execution) => Promise<void>,
  ): void {
    const execution: Execution = {
      runId,
      announced,
      attempt: 0,
      controller: new AbortController(),
      slotted,
      slotAt: performance.now(),
    };
    if (slotted) this.slotted += 1;
    else this.ahead += 1;
    // Claimed from `ready` during a backlog: part of it from its claim on.
    if (!slotted && this.backlog) this.startBacklogCall(execution);
    // An entry replaced here (the poller's claim of a run whose execution is still calling or
    // winding down: its claim expired and the run was re-queued) has lost its claim: its call is
    // aborted now rather than at the claim watch's next check, and it keeps its slot (and the
    // drain waits for it) until it has ended.
    const replaced = this.executing.get(runId);
    if (replaced) {
      this.superseded.add(replaced);
      replaced.controller.abort(new ClaimLostError(`run ${runId} was claimed again by this node`));
    }
    this.executing.set(runId, execution);
    execution.done = work(execution)
      .catch((err: unknown) => this.options.logger.error({ err: toError(err), run: runId }, 'run failed'))
      .finally(() => {
        // The poller may have claimed this run while a late message's claim of it was failing:
        // the entry is then the poller's, which must stay.
        if (this.executing.get(runId) === execution) this.executing.delete(runId);
        this.superseded.delete(execution);
        if (execution.keptSlot) this.sampleSlot(execution);
        this.returnStartPass(execution);
        this.endBacklogCall(execution);
        if (execution.settling) this.settling -= 1;
        if (execution.slotted) this.slotted -= 1;
        else this.ahead -= 1;
        // Held again without the lead: a forbid or replace run is only claimed once due. A draining
        // queue holds nothing new: the other workers get it (a forbid or replace run's claim ahead
        // is always refused, so this is how those runs leave a stopping worker).
        if (execution.rehold && this.draining) this.options.handOff?.([execution.rehold.message]);
        else if (execution.rehold) this.hold(execution.rehold.message, execution.rehold.retries, false);
        this.pump();
        this.checkIdle();
      });
    this.update();
  }

  private async claimAndRun(entry: Held, execution: Execution): Promise<void> {
    execution.callEndsBy = entry.message.notBefore.getTime() + (entry.message.timeoutMs ?? 0);
    const outcome = await this.options.claim(entry.message, entry);
    if (outcome.kind === 'rehold') {
      // Held again once this execution is gone (see track), without the lead.
      execution.rehold ??= {
        message: { ...entry.message, notBefore: outcome.notBefore },
        retries: entry.retries + 1,
      };
      return;
    }
    if (outcome.kind !== 'claimed') return;
    await this.runClaimed(outcome.run, execution);
  }

  /** Waits for the claimed run's time, a start pass and a slot (see below), then runs it. */
  private async runClaimed(run: ClaimedRun, execution: Execution): Promise<void> {
    execution.attempt = run.attempt;
    execution.callEndsBy = run.notBefore.getTime() + run.timeoutMs;
    execution.startPending = run.startPending;
    const signal = execution.controller.signal;
    // Claimed ahead: the call starts when the run is due, not when the claim came back.
    // Rounded up, so a call never starts before its time by our estimate of the database clock.
    // One abort listener for both waits below (see Execution.stopWaiting).
    signal.addEventListener('abort', () => execution.stopWaiting?.(), { once: true });
    await this.untilDue(run.notBefore.getTime(), execution, signal);
    const untilSlot = async () => {
      // Aborted meanwhile (the claim was lost, the worker stopped): run() makes no call then.
      await this.slotFor(execution, signal);
      // A re-sync of the clock estimate during the wait for a slot may have moved the instant later
      // again: no call before it by the estimate (the slot is held meanwhile).
      await this.untilDue(run.notBefore.getTime(), execution, signal);
    };
    // A run still to be marked started is marked while it waits for its slot (a start pass: see
    // START_PASSES_PER_SLOT), so that a slot freed by a call goes to a run ready to call at once,
    // not to one whose START is still on its way. The others take a pass too, and then their slot:
    // the passes are the one queue every claimed run waits in, in order, so a run claimed once due
    // (overdue under a backlog, a forbid or replace run) does not overtake runs claimed before it
    // that still wait for a pass.
    await this.startPassFor(execution, signal);
    if (!run.startPending) await untilSlot();
    // A drain that began while this run waited for its time, or begins before its call, applies to it.
    await this.options.run(
      run,
      signal,
      this.drainLeftNow,
      (called, writeMayWait) => this.callEnded(execution, called, writeMayWait),
      run.startPending ? untilSlot : slotHeld,
    );
  }

  /**
   * Resolves once `notBefore` (database clock, ms) has come by our estimate, rounded up to whole
   * ms so a call never starts before its time, or at once when `signal` aborts. Runs waiting for
   * the same instant share one timer (see {@link DueWait}).
   */
  private untilDue(notBefore: number, execution: Execution, signal: AbortSignal): Promise<void> {
    const delayMs = notBefore - this.options.clock.now();
    if (signal.aborted) return Promise.resolve();
    if (delayMs <= 0) {
      // By a moved-forward estimate the instant has come: the runs already waiting for it (on a
      // timer set under the old estimate) go now too, before this one.
      if (this.dueWaits.has(notBefore)) this.dueCame(notBefore);
      return Promise.resolve();
    }
    const instant = timerOf(
      this.dueWaits,
      notBefore,
      delayMs,
      () => this.dueCame(notBefore),
      (shared) => ({ ...shared, waiters: new Set<() => void>() }),
    );
    return new Promise<void>((resolve) => {
      const done = () => {
        execution.stopWaiting = undefined;
        instant.waiters.delete(done);
        // The last run waiting for it was aborted (a drain, a lost claim): no timer left behind.
        if (instant.waiters.size === 0 && this.dueWaits.get(notBefore) === instant) {
          clearTimeout(instant.timer);
          this.dueWaits.delete(notBefore);
        }
        resolve();
      };
      instant.waiters.add(done);
      execution.stopWaiting = done;
    });
  }

  /**
   * The timer of the instant `notBefore` fired: its runs are due, unless the clock estimate moved
   * it later meanwhile (a re-sync, or a timer cut at MAX_TIMER_MS), and then they wait again.
   */
  private dueCame(notBefore: number): void {
    const due = this.dueWaits.get(notBefore);
    if (!due) return;
    const delayMs = notBefore - this.options.clock.now();
    if (delayMs > 0) {
      rearm(due, delayMs, () => this.dueCame(notBefore));
      return;
    }
    this.dueWaits.delete(notBefore);
    for (const done of due.waiters) done();
  }

  /** Idle: nothing held or executing, and no poll claiming into reserved slots (its runs come next). */
  private checkIdle(): void {
    if (
      this.onIdle &&
      this.held.size === 0 &&
      this.executing.size === 0 &&
      this.superseded.size === 0 &&
      this.reserved === 0
    ) {
      this.onIdle();
    }
  }

  private update(): void {
    // Over once nothing waits and its calls have ended, whatever emptied the queues (forget(), an
    // aborted wait). Safe in the middle of a pump: track() counts its run before it calls this.
    if (this.backlogCalls === 0 && this.ready.length === 0 && !this.waitingForCalls()) {
      this.backlog = false;
    }
    const full = this.held.size >= this.options.prefetch;
    // A draining queue never asks for more: the intake is stopping, and a message it handed us now
    // would be dropped with its offset committed.
    if (full !== this.full && !this.draining) {
      this.full = full;
      this.options.onBackpressure(full);
    }
    if (!this.callsUnderway()) this.options.onCallsCaughtUp?.();
  }
}
