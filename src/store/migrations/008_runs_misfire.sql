-- The job's misfire policy, copied into each run when it is created: a worker that claims a run a
-- leader made before an outage, more than the misfire threshold after it was due, applies the
-- policy of the job as it was then (runs.ts misfiredAtClaim). NULL in runs created before this
-- column: the job's policy is read instead. The check is added NOT VALID: it holds for every row
-- written from now on without reading the whole table under this migration's exclusive lock
-- (327 ms for 2 million runs, blocking every claim and dispatch meanwhile).
ALTER TABLE runs ADD COLUMN misfire text;
ALTER TABLE runs ADD CONSTRAINT runs_misfire_check CHECK (misfire IN ('fire-once', 'fire-all', 'skip')) NOT VALID;
