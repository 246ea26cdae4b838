-- claim.lua: promote due delayed jobs (PROMOTE_LIMIT at most), then lease up to `count`
-- waiting jobs.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 worker id, 6 count (> 0: a claim of none never gets here), 7 lease
--       ms (rules.lease_ms), 8 token base (random per call, rules.token_base; made unique
--       per job by the suffix ".<n>").
-- Returns: {wait_ms, then CLAIM_ROW entries per claimed job: id, token, payload, codec, opts,
--          attempt (charged), waited ms, infra deaths, number (its place in the history),
--          age ms (since enqueue: what the worker has left of its deadline_s)}. A job past
--          its deadline_s or max_queue_s is failed (outcome deadline / expired, never run)
--          instead of claimed: no scan finds it. wait_ms, when nothing was claimed, is how
--          long until the next delayed job falls due (-1: none), so an idle worker blocks
--          exactly that long at most; 0 when jobs are still waiting (a claim that cancelled
--          members of a batch being cancelled stops after TRIM_BUDGET of them). "waited
--          ms" is how long the job waited since it was ready (ready_ms: enqueued, due or
--          retried; created_ms for older records).
-- Upholds: design invariants 1 (fresh token and owner per lease; highest priority first,
-- FIFO within a priority), 2 (expiry = server TIME + lease) and 7 (a broken record fails
-- that one job with a stated cause and the claim goes on).

local now = now_ms()
local out = claim_jobs(ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], now)
local wait_ms = -1
if #out == 0 and redis.call('ZCARD', WAITING) > 0 then
  wait_ms = 0 -- cut short by the members of a batch being cancelled: claim again at once
elseif #out == 0 then
  local first = redis.call('ZRANGE', DELAYED, 0, 0, 'WITHSCORES')
  if #first > 0 then wait_ms = math.max(0, tonumber(first[2]) - now) end
end
table.insert(out, 1, wait_ms)
return out
