-- Why the dispatcher parked a job (next_run_at set to NULL): its schedule could not be evaluated.
-- Shown in the API; cleared when an edit or a resume gives the job a next run again.
ALTER TABLE jobs ADD COLUMN schedule_error text;
