-- A `replace` run's replacement (runs.ts REPLACE_OLDER, `overtaken`) asks whether a run of its job
-- replayed since it was asked for has been claimed: the job's dead letters replayed after a given
-- time. Without this index that read every dead letter of the job (dead_letters_job_idx), on each
-- start of a `replace` run: a poison job keeps one per dead occurrence for the run retention.
-- Partial: only replayed dead letters, a few.
CREATE INDEX dead_letters_job_replayed_idx ON dead_letters (job_id, replayed_at) WHERE replayed_at IS NOT NULL;
