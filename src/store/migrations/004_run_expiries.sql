-- How many times a run's claim expired and was forgiven: re-queued without using up an attempt
-- (the worker died, froze or lost PostgreSQL; the target did not fail). Bounded by the reaper, so
-- a job whose calls keep killing workers still ends dead.
ALTER TABLE runs ADD COLUMN expiries integer NOT NULL DEFAULT 0;
