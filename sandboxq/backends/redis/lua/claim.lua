-- claim.lua: promote due delayed jobs, then lease up to `count` waiting jobs.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 worker id, 6 count, 7 lease ms, 8 token base (random per call,
--       made unique per job by a suffix).
-- Returns: a flat list, 6 entries per claimed job: id, token, payload, codec, opts, attempt.
-- Upholds: invariant 1 (fresh token and owner per lease; highest priority first, FIFO
-- within a priority), invariant 2 (expiry = server TIME + lease), invariant 7 (a broken
-- record fails that one job with a stated cause and the claim goes on).

local now = now_ms()
return claim_jobs(ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], now)
