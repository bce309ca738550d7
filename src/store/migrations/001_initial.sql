-- Helios schema v1: jobs, runs (one row per occurrence), attempts, outbox, leader fence, dead letters.

CREATE TABLE jobs (
  id                 uuid PRIMARY KEY DEFAULT gen_random_uuid(),
  name               text NOT NULL UNIQUE,
  schedule           text NOT NULL,
  timezone           text NOT NULL DEFAULT 'UTC',
  -- { url, method, headers, body }: copied into each run when it is created.
  target             jsonb NOT NULL,
  timeout_ms         integer NOT NULL DEFAULT 30000 CHECK (timeout_ms BETWEEN 100 AND 3600000),
  max_attempts       integer NOT NULL DEFAULT 3 CHECK (max_attempts BETWEEN 1 AND 100),
  backoff_ms         integer NOT NULL DEFAULT 1000 CHECK (backoff_ms BETWEEN 0 AND 86400000),
  backoff_multiplier real NOT NULL DEFAULT 2 CHECK (backoff_multiplier BETWEEN 1 AND 10),
  concurrency        text NOT NULL DEFAULT 'allow' CHECK (concurrency IN ('allow', 'forbid', 'replace')),
  misfire            text NOT NULL DEFAULT 'fire-once' CHECK (misfire IN ('fire-once', 'fire-all', 'skip')),
  max_catch_up       integer NOT NULL DEFAULT 100 CHECK (max_catch_up BETWEEN 1 AND 10000),
  enabled            boolean NOT NULL DEFAULT true,
  -- The next occurrence not yet turned into a run; NULL when the schedule has no future instant.
  next_run_at        timestamptz,
  created_at         timestamptz NOT NULL DEFAULT now(),
  updated_at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX jobs_due_idx ON jobs (next_run_at) WHERE enabled AND next_run_at IS NOT NULL;
CREATE INDEX jobs_created_idx ON jobs (created_at, id);

CREATE TABLE runs (
  id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
  job_id           uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
  scheduled_for    timestamptz NOT NULL,
  trigger          text NOT NULL DEFAULT 'schedule' CHECK (trigger IN ('schedule', 'manual')),
  state            text NOT NULL CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'dead', 'skipped')),
  -- Number of the latest attempt that was claimed (0 = never claimed); a claim increments it.
  attempt          integer NOT NULL DEFAULT 0,
  max_attempts     integer NOT NULL,
  -- Snapshot of the job's target and retry settings when the run was created.
  target           jsonb NOT NULL,
  timeout_ms       integer NOT NULL,
  backoff_ms       integer NOT NULL,
  backoff_multiplier real NOT NULL,
  concurrency      text NOT NULL DEFAULT 'allow',
  -- The earliest instant the next attempt may start (scheduled_for, or after a retry backoff).
  not_before       timestamptz NOT NULL,
  claimed_by       text,
  claim_expires_at timestamptz,
  -- Leader epoch (fencing token) that created the run; NULL for runs created through the API.
  created_epoch    bigint,
  reason           text,
  last_status      integer,
  last_error       text,
  created_at       timestamptz NOT NULL DEFAULT now(),
  started_at       timestamptz,
  finished_at      timestamptz,
  CONSTRAINT runs_one_per_occurrence UNIQUE (job_id, scheduled_for)
);
CREATE INDEX runs_job_history_idx ON runs (job_id, scheduled_for DESC, id DESC);
CREATE INDEX runs_queued_idx ON runs (not_before) WHERE state = 'queued';
CREATE INDEX runs_running_idx ON runs (claim_expires_at) WHERE state = 'running';
CREATE INDEX runs_active_job_idx ON runs (job_id) WHERE state IN ('queued', 'running');
-- concurrency 'forbid': at most one running run per job, enforced by the database at claim time.
CREATE UNIQUE INDEX runs_forbid_one_running_idx ON runs (job_id) WHERE state = 'running' AND concurrency = 'forbid';

CREATE TABLE run_attempts (
  run_id           uuid NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
  attempt          integer NOT NULL,
  node_id          text NOT NULL,
  started_at       timestamptz NOT NULL DEFAULT now(),
  finished_at      timestamptz,
  outcome          text CHECK (outcome IN ('succeeded', 'failed', 'timeout', 'expired', 'replaced', 'cancelled')),
  status_code      integer,
  duration_ms      integer,
  error            text,
  response_excerpt text,
  PRIMARY KEY (run_id, attempt)
);

-- Messages to publish to Kafka, written in the same transaction as the state they announce.
CREATE TABLE outbox (
  id            bigserial PRIMARY KEY,
  topic         text NOT NULL,
  key           text NOT NULL,
  payload       jsonb NOT NULL,
  publish_after timestamptz NOT NULL DEFAULT now(),
  created_at    timestamptz NOT NULL DEFAULT now(),
  published_at  timestamptz,
  publish_tries integer NOT NULL DEFAULT 0,
  last_error    text
);
CREATE INDEX outbox_pending_idx ON outbox (publish_after, id) WHERE published_at IS NULL;
CREATE INDEX outbox_published_idx ON outbox (published_at) WHERE published_at IS NOT NULL;

-- One row: the highest fencing token that has written. A leader write first raises it or fails.
CREATE TABLE leader_fence (
  id         boolean PRIMARY KEY DEFAULT true CHECK (id),
  token      bigint NOT NULL,
  node_id    text,
  updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO leader_fence (id, token) VALUES (true, 0);

CREATE TABLE dead_letters (
  id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
  run_id      uuid NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
  job_id      uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
  attempt     integer NOT NULL,
  error       text,
  status_code integer,
  created_at  timestamptz NOT NULL DEFAULT now(),
  replayed_at timestamptz,
  replay_count integer NOT NULL DEFAULT 0
);
CREATE INDEX dead_letters_created_idx ON dead_letters (created_at DESC, id DESC);
CREATE UNIQUE INDEX dead_letters_open_run_idx ON dead_letters (run_id) WHERE replayed_at IS NULL;

-- Wake-ups: the dispatcher listens for job changes, the relay for new outbox rows.
CREATE FUNCTION helios_notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('helios_jobs', '');
  RETURN NULL;
END $$;
CREATE TRIGGER jobs_changed AFTER INSERT OR UPDATE OF schedule, timezone, enabled OR DELETE ON jobs
  FOR EACH STATEMENT EXECUTE FUNCTION helios_notify_jobs();

CREATE FUNCTION helios_notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('helios_outbox', '');
  RETURN NULL;
END $$;
CREATE TRIGGER outbox_inserted AFTER INSERT ON outbox
  FOR EACH STATEMENT EXECUTE FUNCTION helios_notify_outbox();
