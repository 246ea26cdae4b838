-- oldest_waiting.lua: created_ms of the oldest job first in line at each priority (read-only).
-- KEYS: the standard list (common.lua); reads the waiting ZSET and job hashes.
-- ARGV: 1-4 standard (unused); 5 most priorities to look at.
-- Returns: the oldest created_ms found, or false when nothing waits.
-- Upholds: bounded work (one ZRANGEBYSCORE of one entry per priority, O(log N) each):
-- within a priority the queue is FIFO, so its first job has waited longest; never a scan.

local bands = tonumber(ARGV[5])
local from = '-inf'
local oldest = nil
for _ = 1, bands do
  local head = redis.call('ZRANGEBYSCORE', WAITING, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #head == 0 then break end
  local f = hmget(PREFIX .. head[1], 'created_ms')
  local created = f and tonumber(f[1] or '')
  if created and (oldest == nil or created < oldest) then oldest = created end
  -- the next priority's scores start at the next multiple of PRIORITY_SPAN
  from = '(' .. int((math.floor(tonumber(head[2]) / PRIORITY_SPAN) + 1) * PRIORITY_SPAN)
end
if oldest == nil then return false end
return int(oldest)
