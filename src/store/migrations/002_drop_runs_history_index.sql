-- runs_job_history_idx (job_id, scheduled_for DESC, id DESC) repeated the unique index of
-- runs_one_per_occurrence (job_id, scheduled_for): a job has one run per occurrence, so history
-- pages are ordered by scheduled_for alone and scan that index backwards. Every claim and
-- completion is a non-HOT update of runs (its state changes), which inserts into every index:
-- one index fewer is one index insertion fewer per run created, claimed and completed.
DROP INDEX IF EXISTS runs_job_history_idx;
