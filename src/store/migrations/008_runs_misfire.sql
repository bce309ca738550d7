-- The job's misfire policy, copied into each run when it is created, as its target and retry
-- settings are: a worker that claims a run created in time more than the misfire threshold after it
-- was due applies the policy of the job as it was then (runs.ts misfiredAtClaim), not of a later
-- edit. NULL in runs created before this column: the job's policy is read instead.
ALTER TABLE runs ADD COLUMN misfire text CHECK (misfire IN ('fire-once', 'fire-all', 'skip'));
