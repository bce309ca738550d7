import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { parse, stringify } from 'yaml';
import { CLUSTER_COUNT_CAP } from '../../src/observability/cluster-signals.js';
import { createMetrics } from '../../src/observability/metrics.js';
import { METRIC_LABEL_VALUES, type LabelledMetric } from '../../src/observability/metric-labels.js';
import { REPO_ROOT } from '../support/env.js';

// The alert rules and the dashboard (deploy/) must name only metrics Helios exports, and each
// alert must fire on the situation it describes. The rules are checked and unit-tested with
// promtool (scripts/infra.sh install puts it here; without it those two tests are skipped and
// the rules are only parsed).
const RULES = join(REPO_ROOT, 'deploy/prometheus/alerts.yml');
const DASHBOARD = join(REPO_ROOT, 'deploy/grafana/helios.json');

interface Rule {
  alert: string;
  expr: string;
  for?: string;
  labels?: Record<string, string>;
  annotations: Record<string, string>;
}
const rules = (parse(readFileSync(RULES, 'utf8')) as { groups: { rules: Rule[] }[] }).groups.flatMap(
  (g) => g.rules,
);
const promtool = spawnSync('promtool', ['--version']).status === 0;

/** Metric names in a PromQL expression: Helios's own and the Node.js process metrics. */
function namesIn(expr: string): string[] {
  return [...expr.matchAll(/\b(?:helios|process|nodejs)_[a-z0-9_]+/g)].map((m) => m[0]);
}

function dashboardExprs(): string[] {
  const dashboard = JSON.parse(readFileSync(DASHBOARD, 'utf8')) as {
    panels: { type: string; targets?: { expr: string }[] }[];
  };
  return dashboard.panels.flatMap((p) => (p.targets ?? []).map((t) => t.expr));
}

test('every metric the alert rules and the dashboard name is one a Helios node exports', () => {
  const exported = exportedSeries();
  const exprs = [...rules.map((r) => r.expr), ...dashboardExprs()];
  assert.ok(exprs.length > 20, 'the rules and the dashboard have expressions');
  const unknown = [...new Set(exprs.flatMap(namesIn))].filter((name) => !exported.has(name));
  assert.deepEqual(unknown, [], 'metrics named but not exported');
  // Every metric the issue asks an operator to watch is on the dashboard.
  const shown = new Set(dashboardExprs().flatMap(namesIn));
  for (const name of [
    'helios_outbox_pending_rows',
    'helios_outbox_oldest_pending_age_seconds',
    'helios_runs_queued',
    'helios_runs_overdue',
    'helios_runs_running',
    'helios_dead_letters_open',
    'helios_misfires_total',
    'helios_runs_skipped_total',
    'helios_jobs_parked_total',
    'helios_db_pool_in_use',
    'helios_db_pool_waiting',
    'helios_kafka_consumer_lag_messages',
    'helios_fence_rejections_total',
    'helios_is_leader',
  ])
    assert.ok(shown.has(name), `${name} is not on the dashboard`);
});

/** The labels of each series a node exports, each with the values it can take (undefined: any). */
type LabelSpace = Map<string, readonly string[] | undefined>;

/**
 * Every series a node exports, read from its registry with the leader's gauges on, with its labels:
 * each metric's labelNames as registered (metrics.ts), with the values METRIC_LABEL_VALUES lists,
 * which the compiler holds the code's call sites to; and `node`, the registry's default label.
 * Histograms and summaries are queried through their series (`_bucket` with `le`, `_sum`,
 * `_count`). Prometheus adds `job` and `instance` to `up` (the job's name is the operator's:
 * docs/operations.md asks for `helios`).
 */
function exportedSeries(): Map<string, LabelSpace> {
  const metrics = createMetrics('series');
  metrics.exportClusterGauges(true);
  const spaces = new Map<string, LabelSpace>([
    [
      'up',
      new Map([
        ['job', undefined],
        ['instance', undefined],
      ]),
    ],
  ]);
  for (const metric of metrics.registry.getMetricsAsArray()) {
    const {
      name,
      type,
      labelNames = [],
    } = metric as unknown as { name: string; type: string; labelNames?: string[] };
    const listed: Record<string, readonly string[]> = METRIC_LABEL_VALUES[name as LabelledMetric] ?? {};
    const space: LabelSpace = new Map([
      ['node', undefined],
      ...labelNames.map((l) => [l, listed[l]] as const),
      ...(type === 'summary' ? [['quantile', undefined] as const] : []),
    ]);
    spaces.set(name, space);
    if (type !== 'histogram' && type !== 'summary') continue;
    for (const suffix of ['_sum', '_count']) spaces.set(`${name}${suffix}`, space);
    if (type === 'histogram') spaces.set(`${name}_bucket`, new Map([...space, ['le', undefined]]));
  }
  return spaces;
}

/** One label matcher of a selector: `helios_db_pool_waiting{pool="leader"}`; op and value absent in
 * the runbooks' `helios_prune_passes_total{table,result="succeeded"}`, which only name labels. */
interface Matcher {
  readonly metric: string;
  readonly label: string;
  readonly op?: '=' | '!=' | '=~' | '!~';
  readonly value?: string;
}

/**
 * The label matchers of Helios's (and Prometheus's `up`) selectors in a PromQL expression or in
 * prose: a metric name, then `{…}` holding comma-separated `label`, `label="v"`, `label=~"a|b"`, ….
 * No PromQL parser is installed; the rules' matchers are this simple (no commas or braces inside
 * values), and an item that does not read as a matcher is reported rather than skipped.
 */
function matchersIn(text: string): (Matcher | { readonly unparsed: string })[] {
  const found: (Matcher | { readonly unparsed: string })[] = [];
  for (const [, metric, body] of text.matchAll(/\b((?:helios|process|nodejs)_[a-z0-9_]+|up)\{([^}]*)\}/g))
    for (const item of body!.split(',')) {
      const m = /^\s*([a-zA-Z_]\w*)\s*(?:(=~|!~|!=|=)\s*"([^"]*)")?\s*$/.exec(item);
      if (!m) found.push({ unparsed: `${metric}{${body}}` });
      else found.push({ metric: metric!, label: m[1]!, op: m[2] as Matcher['op'], value: m[3] });
    }
  return found;
}

/**
 * What is wrong with `label` (and its values) on one of `metrics`: a label none of them has, or a
 * value none of them emits. Values are literals, or for =~ regular expressions, each alternative
 * of which must match a value some metric emits (an alternative no series can match is a slip).
 */
function labelProblem(
  spaces: Map<string, LabelSpace>,
  metrics: readonly string[],
  label: string,
  values: readonly string[],
  regex = false,
): string | undefined {
  const having = metrics.filter((m) => spaces.get(m)?.has(label));
  if (having.length === 0) return `label ${label} is not one of ${metrics.join(', ')}`;
  if (having.some((m) => spaces.get(m)!.get(label) === undefined)) return undefined; // any value
  const emitted = new Set(having.flatMap((m) => spaces.get(m)!.get(label)!));
  const unknown = values.filter((v) =>
    regex ? ![...emitted].some((e) => new RegExp(`^(?:${v})$`).test(e)) : !emitted.has(v),
  );
  if (unknown.length > 0) return `${label}: ${unknown.join(', ')} not among ${[...emitted].join(', ')}`;
  return undefined;
}

/** Problems with the label matchers of selectors in `text` (an expression, or prose quoting them). */
function selectorProblems(spaces: Map<string, LabelSpace>, text: string): string[] {
  return matchersIn(text).flatMap((m) => {
    if ('unparsed' in m) return [`unparsed selector ${m.unparsed}`];
    if (!spaces.has(m.metric)) return []; // an unknown metric: the test of names reports it
    // A negative matcher on a value never emitted excludes nothing; only = and =~ are checked.
    const values = m.op === '=' ? [m.value!] : m.op === '=~' ? m.value!.split('|') : [];
    const problem = labelProblem(spaces, [m.metric], m.label, values, m.op === '=~');
    return problem ? [`${m.metric}{${m.label}${m.op ?? ''}${m.value ?? ''}}: ${problem}`] : [];
  });
}

/**
 * Problems with the labels a rule's expression aggregates by, and the labels its text names
 * without a selector: `loop=dispatch`, `pool=leader`, "(label loop - dispatch or reaper)",
 * "(labels node, pool)". Each must be a label of a metric of the rule's expression, with a value
 * it emits.
 */
function ruleTextProblems(spaces: Map<string, LabelSpace>, rule: Rule): string[] {
  const metrics = [...new Set([...namesIn(rule.expr), ...(/\bup\{/.test(rule.expr) ? ['up'] : [])])];
  const named: [label: string, values: string[]][] = [];
  for (const [, labels] of rule.expr.matchAll(/\b(?:by|without)\s*\(([^)]*)\)/g))
    for (const label of labels!.split(',')) named.push([label.trim(), []]);
  for (const text of Object.values(rule.annotations)) {
    // label=value outside a selector's braces (those are read by selectorProblems).
    for (const [, label, value] of text.matchAll(/(?<![\w{,"=])([a-z_]+)=([a-z][\w-]*)/g))
      named.push([label!, [value!]]);
    for (const [, inside] of text.matchAll(/\(labels? ([^)]*)\)/g)) {
      const [labels, values = ''] = inside!.split(' - ');
      const listed = values.split(/, | or /).filter((v) => v !== '');
      for (const label of labels!.split(', ')) named.push([label, listed]);
    }
  }
  return named.flatMap(([label, values]) => {
    const problem = labelProblem(spaces, metrics, label, values);
    return problem ? [`${rule.alert}: ${problem}`] : [];
  });
}

test('every label the alert rules, their text, the dashboard and the runbooks match is one the metric has, with a value Helios emits', () => {
  const spaces = exportedSeries();
  // The typed list covers every labelled Helios metric, with the labels it is registered with.
  for (const [name, space] of spaces)
    if (name.startsWith('helios_') && !/_(bucket|sum|count)$/.test(name) && space.size > 1)
      assert.deepEqual(
        Object.keys(METRIC_LABEL_VALUES[name as LabelledMetric] ?? {}).sort(),
        [...space.keys()].filter((l) => l !== 'node').sort(),
        `METRIC_LABEL_VALUES lists ${name}'s labels`,
      );
  for (const name of Object.keys(METRIC_LABEL_VALUES)) assert.ok(spaces.has(name), `${name} is exported`);

  const runbooks = ['README.md', 'docs/operations.md'].map((f) => readFileSync(join(REPO_ROOT, f), 'utf8'));
  const texts = [
    ...rules.flatMap((r) => [r.expr, ...Object.values(r.annotations)]),
    ...dashboardExprs(),
    ...runbooks,
  ];
  // The runbooks' `loop=dispatch` and the like: a label of some Helios metric, with a value of it.
  const labelled = [...spaces.keys()].filter((m) => m.startsWith('helios_'));
  const runbookPairs = runbooks.flatMap((text) =>
    [...text.matchAll(/`([a-z_]+)=([a-z][\w-]*)`/g)].flatMap(([, label, value]) => {
      const metrics = labelled.filter((m) => spaces.get(m)!.has(label!));
      const problem = metrics.length > 0 ? labelProblem(spaces, metrics, label!, [value!]) : undefined;
      return problem ? [`runbook \`${label}=${value}\`: ${problem}`] : [];
    }),
  );
  const problems = [
    ...texts.flatMap((text) => selectorProblems(spaces, text)),
    ...rules.flatMap((rule) => ruleTextProblems(spaces, rule)),
    ...runbookPairs,
  ];
  assert.deepEqual(problems, [], 'label matchers that name a label or value no Helios series has');
  // The matchers were read: the rules' own, and the bare ones of their text.
  assert.ok(texts.flatMap(matchersIn).length > 20, 'label matchers found');
});

test('every alert says what happened and what to do, with a severity', () => {
  assert.deepEqual(rules.map((r) => r.alert).sort(), [
    'HeliosCallsNotRecorded',
    'HeliosClaimsTooLate',
    'HeliosClockEstimateEarly',
    'HeliosClusterGaugesStale',
    'HeliosDbPoolWaiting',
    'HeliosDeadLettersRising',
    'HeliosFenceRejections',
    'HeliosJobsParked',
    'HeliosKafkaLag',
    'HeliosLeaderPassesFailing',
    'HeliosNoLeader',
    'HeliosNodeDown',
    'HeliosOutboxStalled',
    'HeliosPruningFailing',
    'HeliosRunsOverdueGrowing',
  ]);
  for (const rule of rules) {
    assert.ok(rule.annotations.summary && rule.annotations.description, `${rule.alert} lacks text`);
    assert.match(rule.labels?.severity ?? '', /^(critical|warning)$/, rule.alert);
  }
});

test("HeliosRunsOverdueGrowing's cap is the leader's count cap", () => {
  // At the cap the overdue count cannot grow: the rule fires on reaching it.
  const rule = rules.find((r) => r.alert === 'HeliosRunsOverdueGrowing')!;
  assert.match(rule.expr, new RegExp(`max\\(helios_runs_overdue\\) >= ${CLUSTER_COUNT_CAP}\\b`));
});

test('promtool accepts the rules', { skip: !promtool && 'promtool is not installed' }, () => {
  const result = spawnSync('promtool', ['check', 'rules', RULES], { encoding: 'utf8' });
  assert.equal(result.status, 0, result.stdout + result.stderr);
});

/** One promtool unit test: input series, and the alerts expected (or none) at a time. */
interface Case {
  readonly name: string;
  readonly interval?: string;
  readonly series: Record<string, string>;
  readonly at: string;
  readonly alert: string;
  /** Labels of each expected alert besides alertname and severity; [] = must not fire. */
  readonly fires: Record<string, string>[];
}

const CASES: Case[] = [
  {
    name: 'no leader for 30 s',
    interval: '15s',
    series: { 'helios_is_leader{node="a"}': '1 1 0 0 0 0', 'helios_is_leader{node="b"}': '0 0 0 0 0 0' },
    at: '75s',
    alert: 'HeliosNoLeader',
    fires: [{}],
  },
  {
    name: 'a leader, no alert',
    interval: '15s',
    series: { 'helios_is_leader{node="a"}': '0 0 0 0 0 0', 'helios_is_leader{node="b"}': '1 1 1 1 1 1' },
    at: '75s',
    alert: 'HeliosNoLeader',
    fires: [],
  },
  {
    name: 'no node exports anything',
    interval: '15s',
    series: { 'helios_runs_created_total{node="a"}': '0 _ _ _ _ _' },
    at: '75s',
    alert: 'HeliosNoLeader',
    fires: [{}],
  },
  {
    name: 'outbox row older than 30 s',
    interval: '15s',
    series: { 'helios_outbox_oldest_pending_age_seconds{node="a"}': '0 0 15 30 45' },
    at: '60s',
    alert: 'HeliosOutboxStalled',
    fires: [{}],
  },
  {
    name: 'outbox row 30 s old, not yet',
    interval: '15s',
    series: { 'helios_outbox_oldest_pending_age_seconds{node="a"}': '0 0 15 30' },
    at: '45s',
    alert: 'HeliosOutboxStalled',
    fires: [],
  },
  {
    // The refused row is put off and tried again, so the age gauge never passes 30 s.
    name: 'the broker refuses a row, tried again every minute',
    interval: '1m',
    series: {
      'helios_outbox_oldest_pending_age_seconds{node="a"}': '0x10',
      'helios_outbox_rows_refused_total{node="a"}': '0 0 1 2 3 4 5 6 7 8 9',
    },
    at: '10m',
    alert: 'HeliosOutboxStalled',
    fires: [{}],
  },
  {
    name: 'a row refused once, then published (the topic was fixed) 10 minutes ago',
    interval: '1m',
    series: {
      'helios_outbox_oldest_pending_age_seconds{node="a"}': '0x20',
      'helios_outbox_rows_refused_total{node="a"}': '0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1',
    },
    at: '20m',
    alert: 'HeliosOutboxStalled',
    fires: [],
  },
  {
    name: 'overdue runs growing',
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '0+10x20' },
    at: '15m',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [{}],
  },
  {
    name: 'overdue runs steady',
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '50x20' },
    at: '15m',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [],
  },
  {
    // No worker claims (all stopped, or cut off from PostgreSQL) and the jobs fall due every ten
    // minutes: the overdue count grows by a step each time and is flat in between, so its 5-minute
    // slope is positive for at most 5 minutes at a time and a 5-minute `for` never completed.
    name: 'overdue runs growing by a step every ten minutes (workers stopped, jobs every 10 min)',
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '0x9 1x9 2x9 3x9 4x9 5x9' },
    at: '55m',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [{}],
  },
  {
    name: 'overdue runs growing by a herd every hour (workers stopped, a herd at the top of each hour)',
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '0x4 10000x59 20000x59 30000x59' },
    at: '2h40m',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [{}],
  },
  {
    // The leader counts overdue runs up to 100,000 (CLUSTER_COUNT_CAP): at the cap the count stops
    // growing however many more are overdue, and the runs are still not claimed.
    name: 'overdue runs at the count cap for over an hour',
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '0+20000x5 100000x100' },
    at: '1h40m',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [{}],
  },
  {
    name: 'a herd each hour, drained in two minutes, a little larger each time',
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '0x4 8000 3000 0x57 9000 4000 0x57 10000 5000 0x10' },
    at: '2h15m',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [],
  },
  {
    name: 'a backlog draining slowly after a burst (workers catching up)',
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '0x4 5000-100x40' },
    at: '40m',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [],
  },
  {
    // One run nobody claims: it fires within 10 minutes. A `forbid` job's replay waiting for its
    // running sibling (a call of minutes) did so too while helios_runs_overdue counted it: the
    // leader counts such waits apart (helios_runs_waiting_forbid, store/signals.ts).
    name: 'one run overdue and unclaimed for 10 minutes',
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '0x4 1x120' },
    at: '15m',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [{}],
  },
  {
    name: "one run overdue for two hours: the last hour's low has caught up",
    interval: '1m',
    series: { 'helios_runs_overdue{node="a"}': '0x4 1x120' },
    at: '2h',
    alert: 'HeliosRunsOverdueGrowing',
    fires: [],
  },
  {
    name: 'a dead letter',
    interval: '1m',
    series: { 'helios_dead_letters_total{node="a"}': '0 0 0 1 1 1' },
    at: '5m',
    alert: 'HeliosDeadLettersRising',
    fires: [{}],
  },
  {
    name: 'no new dead letter for 15 minutes',
    interval: '1m',
    series: { 'helios_dead_letters_total{node="a"}': '1x30' },
    at: '25m',
    alert: 'HeliosDeadLettersRising',
    fires: [],
  },
  {
    name: 'a fence rejection',
    interval: '1m',
    series: { 'helios_fence_rejections_total{node="b"}': '0 0 1 1' },
    at: '3m',
    alert: 'HeliosFenceRejections',
    fires: [{}],
  },
  {
    name: 'a parked job',
    interval: '1m',
    series: { 'helios_jobs_parked_total{node="a"}': '0 0 1 1' },
    at: '3m',
    alert: 'HeliosJobsParked',
    fires: [{}],
  },
  {
    name: 'Kafka lag for 5 minutes',
    interval: '1m',
    series: { 'helios_kafka_consumer_lag_messages{node="a"}': '5000x10' },
    at: '6m',
    alert: 'HeliosKafkaLag',
    fires: [{}],
  },
  {
    name: 'a short Kafka lag',
    interval: '1m',
    series: { 'helios_kafka_consumer_lag_messages{node="a"}': '5000 5000 0 0 0 0 0 0' },
    at: '6m',
    alert: 'HeliosKafkaLag',
    fires: [],
  },
  {
    name: 'callers waiting for the leader pool all the time',
    interval: '1m',
    series: {
      'helios_db_pool_waiting{node="a",pool="leader"}': '0x10 3x15',
      'helios_db_pool_saturated_seconds_total{node="a",pool="leader"}': '0x10 0+60x15',
      'helios_db_pool_waiting{node="a",pool="main"}': '0x25',
      'helios_db_pool_saturated_seconds_total{node="a",pool="main"}': '0x25',
    },
    at: '24m',
    alert: 'HeliosDbPoolWaiting',
    fires: [{ node: 'a', pool: 'leader' }],
  },
  {
    // Exhausted two thirds of the time, its queue empty at every other scrape: the waiting gauge
    // never read above 0 for 5 minutes on end.
    name: 'a pool exhausted most of the time, its queue empty at every other scrape',
    interval: '1m',
    series: {
      'helios_db_pool_waiting{node="a",pool="worker"}': '3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3 0 3',
      'helios_db_pool_saturated_seconds_total{node="a",pool="worker"}': '0+40x20',
    },
    at: '16m',
    alert: 'HeliosDbPoolWaiting',
    fires: [{ node: 'a', pool: 'worker' }],
  },
  {
    name: 'a herd at the top of the hour queues for 4 minutes',
    interval: '1m',
    series: {
      'helios_db_pool_waiting{node="a",pool="worker"}': '0x60 500 400 300 200 0x20',
      'helios_db_pool_saturated_seconds_total{node="a",pool="worker"}': '0x60 60 120 180 240 240x20',
    },
    at: '1h10m',
    alert: 'HeliosDbPoolWaiting',
    fires: [],
  },
  {
    name: 'callers wait now and then, a sixth of the time',
    interval: '1m',
    series: { 'helios_db_pool_saturated_seconds_total{node="a",pool="main"}': '0+10x30' },
    at: '25m',
    alert: 'HeliosDbPoolWaiting',
    fires: [],
  },
  {
    // PostgreSQL unreachable from 5m: the leader keeps its lease (etcd) and its last readings.
    name: "the leader's cluster gauges stop being read",
    interval: '1m',
    series: { 'helios_cluster_signals_updated_timestamp_seconds{node="a"}': '0+60x5 300x10' },
    at: '11m',
    alert: 'HeliosClusterGaugesStale',
    fires: [{}],
  },
  {
    // PostgreSQL unreachable from 5m: each leader steps down after a few seconds and another
    // takes over, exporting 0 (no reading yet) for its epoch; at some scrapes no node exports it.
    name: 'the lead passes from node to node while PostgreSQL is down, gaps between epochs',
    interval: '30s',
    series: {
      'helios_cluster_signals_updated_timestamp_seconds{node="a"}':
        '0+30x10 300 300 300 stale _ _ _ _ _ _ 0 0 0 stale _ _ _ _ _ _ 0 0 0 stale',
      'helios_cluster_signals_updated_timestamp_seconds{node="b"}':
        '_x17 0 0 0 stale _ _ _ _ _ _ 0 0 0 stale _ _ _ _',
    },
    at: '17m',
    alert: 'HeliosClusterGaugesStale',
    fires: [{}],
  },
  {
    name: 'a leader elected while PostgreSQL is down has never read them',
    interval: '1m',
    series: { 'helios_cluster_signals_updated_timestamp_seconds{node="b"}': '0x10' },
    at: '6m',
    alert: 'HeliosClusterGaugesStale',
    fires: [{}],
  },
  {
    name: 'the cluster gauges stale for 4 minutes (a slow PostgreSQL failover), then read again',
    interval: '1m',
    series: { 'helios_cluster_signals_updated_timestamp_seconds{node="a"}': '0+60x5 300x3 540+60x10' },
    at: '8m45s',
    alert: 'HeliosClusterGaugesStale',
    fires: [],
  },
  {
    name: 'the cluster gauges read every 5 seconds',
    interval: '15s',
    series: { 'helios_cluster_signals_updated_timestamp_seconds{node="a"}': '-5+15x40' },
    at: '10m',
    alert: 'HeliosClusterGaugesStale',
    fires: [],
  },
  {
    name: 'every sweep of runs has failed for over an hour; the outbox is pruned',
    interval: '1m',
    series: {
      'helios_prune_passes_total{node="a",table="runs",result="succeeded"}': '0+1x10 10x80',
      'helios_prune_passes_total{node="a",table="runs",result="failed"}': '0x10 1+1x80',
      'helios_prune_passes_total{node="a",table="outbox",result="succeeded"}': '0+12x90',
      'helios_prune_passes_total{node="a",table="outbox",result="failed"}': '0x90',
    },
    at: '85m',
    alert: 'HeliosPruningFailing',
    fires: [{ table: 'runs' }],
  },
  {
    name: "one job's runs cannot be pruned, sweep after sweep",
    interval: '1m',
    series: {
      'helios_prune_passes_total{node="a",table="runs",result="succeeded"}': '0x60',
      'helios_prune_passes_total{node="a",table="runs",result="incomplete"}': '0+1x60',
    },
    at: '45m',
    alert: 'HeliosPruningFailing',
    fires: [{ table: 'runs' }],
  },
  {
    // Without PostgreSQL the lead passes from node to node every few seconds; no pass ends within
    // an epoch, so none is counted, failed or not.
    name: 'PostgreSQL gone for over an hour, the lead passing from node to node',
    interval: '1m',
    series: {
      'helios_prune_passes_total{node="a",table="outbox",result="succeeded"}': '0+12x10 120x80',
      'helios_prune_passes_total{node="a",table="outbox",result="failed"}': '0x90',
      'helios_prune_passes_total{node="b",table="outbox",result="succeeded"}': '_x12 0x78',
      'helios_prune_passes_total{node="b",table="outbox",result="failed"}': '_x12 0x78',
    },
    at: '85m',
    alert: 'HeliosPruningFailing',
    fires: [{ table: 'outbox' }],
  },
  {
    name: 'every pass fails in a 40-minute PostgreSQL outage, the last minute of it',
    interval: '1m',
    series: {
      'helios_prune_passes_total{node="a",table="outbox",result="succeeded"}': '0+12x10 120x40 132+12x20',
      'helios_prune_passes_total{node="a",table="outbox",result="failed"}': '0x10 1+1x40 41x20',
    },
    at: '49m',
    alert: 'HeliosPruningFailing',
    fires: [],
  },
  {
    name: 'passes fail now and then among successes',
    interval: '1m',
    series: {
      'helios_prune_passes_total{node="a",table="outbox",result="succeeded"}': '0+11x120',
      'helios_prune_passes_total{node="a",table="outbox",result="failed"}': '0+1x120',
    },
    at: '2h',
    alert: 'HeliosPruningFailing',
    fires: [],
  },
  {
    name: 'a call ended after its claim was lost',
    interval: '1m',
    series: { 'helios_stale_completions_total{node="b"}': '0 0 1 1' },
    at: '3m',
    alert: 'HeliosCallsNotRecorded',
    fires: [{}],
  },
  {
    name: 'no call lost its claim for 15 minutes',
    interval: '1m',
    series: { 'helios_stale_completions_total{node="b"}': '2x30' },
    at: '25m',
    alert: 'HeliosCallsNotRecorded',
    fires: [],
  },
  {
    name: 'a node unreachable for 3 minutes',
    interval: '1m',
    series: {
      'up{job="helios",instance="helios-2:8080"}': '1 1 0 0 0 0',
      'up{job="helios",instance="helios-1:8080"}': '1 1 1 1 1 1',
    },
    at: '5m',
    alert: 'HeliosNodeDown',
    fires: [{ job: 'helios', instance: 'helios-2:8080' }],
  },
  {
    name: 'a node restarted within a minute',
    interval: '1m',
    series: { 'up{job="helios",instance="helios-2:8080"}': '1 1 0 1 1 1' },
    at: '5m',
    alert: 'HeliosNodeDown',
    fires: [],
  },
  {
    name: "a worker's clock estimate ran early once",
    interval: '1m',
    series: {
      'helios_starts_early_total{node="b"}': '0 0 3 3',
      'helios_starts_early_total{node="c"}': '0 0 0 0',
    },
    at: '3m',
    alert: 'HeliosClockEstimateEarly',
    fires: [{ node: 'b' }],
  },
  {
    name: 'no early estimate for 15 minutes',
    interval: '1m',
    series: { 'helios_starts_early_total{node="b"}': '3x30' },
    at: '25m',
    alert: 'HeliosClockEstimateEarly',
    fires: [],
  },
  {
    // A lasting loop on one node (its grace too small for its load, say): a fifth of its claims
    // handed back, claimed again, handed back. The cluster's share is under 1 %: read per node.
    name: 'a node hands back a fifth of its claims as too late for 20 minutes',
    interval: '1m',
    series: {
      'helios_run_claims_total{node="a",source="kafka",result="claimed"}': '0+600x30',
      'helios_run_claims_total{node="b",source="kafka",result="claimed"}': '0+25x30',
      'helios_run_claims_total{node="b",source="poll",result="claimed"}': '0+5x30',
      'helios_runs_executed_total{node="b",outcome="claim-too-late"}': '0+6x30',
      'helios_runs_executed_total{node="b",outcome="succeeded"}': '0+24x30',
    },
    at: '20m',
    alert: 'HeliosClaimsTooLate',
    fires: [{ node: 'b' }],
  },
  {
    // PostgreSQL gone a minute, then back: the herd due meanwhile is claimed, and most of it
    // handed back, within 30 s; then none. Evaluated while the burst is still in the window.
    name: 'a herd handed back as too late in 30 s as PostgreSQL comes back, then none',
    interval: '15s',
    series: {
      'helios_run_claims_total{node="a",source="kafka",result="claimed"}':
        '0+10x20 200x4 1700 3200 3200+10x40',
      'helios_runs_executed_total{node="a",outcome="claim-too-late"}': '0x25 1000 2000 2000x40',
    },
    at: '10m45s',
    alert: 'HeliosClaimsTooLate',
    fires: [],
  },
  {
    // A slow recovery: claims answered late for 4 minutes. Past 5 minutes after its end the
    // window no longer holds it; with a window as long as the `for`, this fired.
    name: 'claims handed back as too late for 4 minutes, 8 minutes ago',
    interval: '1m',
    series: {
      'helios_run_claims_total{node="a",source="kafka",result="claimed"}': '0+100x30',
      'helios_runs_executed_total{node="a",outcome="claim-too-late"}': '0x5 0+50x4 200x20',
    },
    at: '18m',
    alert: 'HeliosClaimsTooLate',
    fires: [],
  },
  {
    name: 'a busy node hands back a claim or two a minute among a thousand',
    interval: '1m',
    series: {
      'helios_run_claims_total{node="a",source="kafka",result="claimed"}': '0+1000x40',
      'helios_runs_executed_total{node="a",outcome="claim-too-late"}': '0+2x40',
    },
    at: '35m',
    alert: 'HeliosClaimsTooLate',
    fires: [],
  },
  {
    name: "the reaper's passes fail every minute or two for 20 minutes",
    interval: '1m',
    series: {
      'helios_leader_pass_failures_total{node="a",loop="reaper"}':
        '0 1 1 2 3 3 4 5 5 6 7 7 8 9 9 10 11 11 12 13 13',
      'helios_leader_pass_failures_total{node="a",loop="dispatch"}': '0x20',
    },
    at: '20m',
    alert: 'HeliosLeaderPassesFailing',
    fires: [{ loop: 'reaper' }],
  },
  {
    name: 'a 10 s PostgreSQL restart fails a burst of dispatch passes, then none',
    interval: '1m',
    series: {
      'helios_leader_pass_failures_total{node="a",loop="dispatch"}': '0 0 9 9 9 9 9 9 9 9 9 9 9 9 9 9',
    },
    at: '15m',
    alert: 'HeliosLeaderPassesFailing',
    fires: [],
  },
];

test(
  'promtool unit tests: each alert fires on its situation and not otherwise',
  { skip: !promtool && 'promtool is not installed' },
  () => {
    const byName = new Map(rules.map((r) => [r.alert, r]));
    const dir = mkdtempSync(join(tmpdir(), 'helios-alerts-'));
    try {
      const file = join(dir, 'alerts.test.yml');
      writeFileSync(
        file,
        stringify({
          rule_files: [RULES],
          evaluation_interval: '15s',
          tests: CASES.map((c) => ({
            name: c.name,
            interval: c.interval ?? '1m',
            input_series: Object.entries(c.series).map(([series, values]) => ({ series, values })),
            alert_rule_test: [
              {
                eval_time: c.at,
                alertname: c.alert,
                exp_alerts: c.fires.map((labels) => ({
                  exp_labels: { severity: byName.get(c.alert)!.labels!.severity, ...labels },
                  // Annotations are plain text (no templates), so they are the rule's own.
                  exp_annotations: byName.get(c.alert)!.annotations,
                })),
              },
            ],
          })),
        }),
      );
      const result = spawnSync('promtool', ['test', 'rules', file], { encoding: 'utf8' });
      assert.equal(result.status, 0, result.stdout + result.stderr);
      // Every alert has at least one case in which it fires.
      for (const rule of rules)
        assert.ok(
          CASES.some((c) => c.alert === rule.alert && c.fires.length > 0),
          `${rule.alert} has no case`,
        );
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  },
);
