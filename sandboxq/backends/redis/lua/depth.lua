-- depth.lua: note how many jobs wait this minute (the dashboard's depth chart).
-- KEYS: the standard list (common.lua); reads the waiting ZSET, writes sq:{q}:depth (derived
--       from the job prefix, as the batch keys are; keys.py).
-- ARGV: 1-4 standard; 5 minutes of samples kept.
-- Returns: the number of jobs waiting.
-- Upholds: bounded memory: one HASH of minute -> waiting count, at most ARGV[5] + 5 fields,
-- and it expires when no worker of the queue has sampled it for twice that long. Run by
-- each worker's registry refresh (every few seconds): the last one in a minute wins, and
-- the minute comes from the server's clock, so workers agree on it.

local keep = tonumber(ARGV[5])
local depth_key = string.sub(PREFIX, 1, -5) .. 'depth'
local minute = math.floor(now_ms() / 60000)
local waiting = redis.call('ZCARD', WAITING)
redis.call('HSET', depth_key, int(minute), waiting)
if redis.call('HLEN', depth_key) > keep + 5 then
  for _, field in ipairs(redis.call('HKEYS', depth_key)) do
    if (tonumber(field) or 0) <= minute - keep then redis.call('HDEL', depth_key, field) end
  end
end
redis.call('PEXPIRE', depth_key, keep * 2 * 60000)
return waiting
