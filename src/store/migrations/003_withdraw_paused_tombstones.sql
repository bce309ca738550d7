-- A pause used to mark runs created ahead of their time `skipped` (reason 'paused'); a resume's
-- new runs for the same instants then hit UNIQUE (job_id, scheduled_for) and were lost. A pause
-- now deletes them instead (store/jobs.ts WITHDRAW_FUTURE_RUNS); delete the tombstones of the old
-- behaviour that still lie ahead, so resumed jobs' next occurrences can be created.
DELETE FROM runs WHERE state = 'skipped' AND reason = 'paused' AND scheduled_for > now();
