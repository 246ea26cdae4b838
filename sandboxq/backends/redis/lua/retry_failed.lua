-- retry_failed.lua: put a failed or cancelled job back in line, attempts reset.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 job id.
-- Returns: 1 put back (waiting, or delayed while fenced), 0 unknown or not failed/cancelled.
-- Upholds: design invariant 3 (the job's history is kept; only its counters restart), the
-- unique-id rule (the same record is reused, never duplicated) and design invariant 12 across a
-- hand-over: a job cancelled while active whose owner has not confirmed its child dead
-- (confirm_dead.lua) is fenced: it goes to delayed, due when the old lease would have run
-- out, so it cannot start anywhere while the cancelled attempt may still run.

return retry_job(ARGV[5])
