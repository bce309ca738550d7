-- dead_letters.run_id and dead_letters.job_id reference runs and jobs ON DELETE CASCADE, but the
-- only index on run_id was partial (open dead letters, for uniqueness) and job_id had none: each
-- run deleted, by the pruner or with its job, scanned the whole table for its dead letters. With
-- 100,000 dead letters a run's delete took ~6 ms, and a prune statement of 6,500 runs hit the 30 s
-- statement timeout, rolled back, and did so again on every pass: pruning stopped for good, and
-- dead letters only go with their runs. Plain indexes let each cascade look its rows up
-- (the same sweep: 296 ms).
CREATE INDEX dead_letters_run_idx ON dead_letters (run_id);
CREATE INDEX dead_letters_job_idx ON dead_letters (job_id);
