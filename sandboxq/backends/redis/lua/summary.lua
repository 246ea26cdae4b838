-- summary.lua: one queue's line of the dashboard's overview, in one call (read-only).
-- KEYS: the standard list (common.lua); reads the six state sets, the jobs first in line
--       and their hashes, the worker registry (sq:{q}:workers) and its records, and the
--       depth history (sq:{q}:depth, written by depth.lua).
-- ARGV: 1-4 standard (unused); 5 most priorities to look at; 6 most workers to read; 7
--       the minutes of depth history kept (DEPTH_MINUTES).
-- Returns: the six counts (waiting, delayed, active, completed, failed, cancelled); the
--          oldest created_ms among the jobs first in line at each priority (false: none
--          waits); live workers among those read; 1 if the registry holds more than were
--          read, else 0; 1 if the depth history could be read (a hash of at most twice
--          ARGV[7] fields), else 0; then its fields and values, flat.
-- Upholds: bounded work whatever the queue holds: a ZCARD per state, one ZRANGEBYSCORE
-- of one entry per priority (within a priority the queue is FIFO, so its first job has
-- waited longest), at most ARGV[6] workers with an EXISTS each, and a hash of about an
-- hour of minutes. Never a scan. One round trip on the queue's own lane: the overview
-- read these in six through the client per queue, 0.33 s a page of 200 queues on a
-- Cluster.

local bands, cap = tonumber(ARGV[5]), tonumber(ARGV[6])
local out = {}
for _, set in ipairs({WAITING, DELAYED, ACTIVE, COMPLETED, FAILED, CANCELLED}) do
  out[#out + 1] = redis.call('ZCARD', set)
end

local from, oldest = '-inf', nil
for _ = 1, bands do
  local head = redis.call('ZRANGEBYSCORE', WAITING, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #head == 0 then break end
  local f = hmget(PREFIX .. head[1], 'created_ms')
  local created = f and tonumber(f[1] or '')
  if created and (oldest == nil or created < oldest) then oldest = created end
  -- the next priority's scores start at the next multiple of PRIORITY_SPAN
  from = '(' .. int((math.floor(tonumber(head[2]) / PRIORITY_SPAN) + 1) * PRIORITY_SPAN)
end
out[#out + 1] = oldest and int(oldest) or false

local scan = redis.call('SSCAN', QUEUE_BASE .. 'workers', 0, 'COUNT', cap)
local members, live = scan[2], 0
for i = 1, math.min(#members, cap) do
  live = live + redis.call('EXISTS', QUEUE_BASE .. 'worker:' .. members[i])
end
out[#out + 1] = live
out[#out + 1] = (scan[1] ~= '0' or #members > cap) and 1 or 0

-- a depth history of the wrong type, or padded by hand past what depth.lua keeps (an
-- hour's minutes and a few: a million fields held the server 1.8 s a page), costs only
-- the chart
local key = QUEUE_BASE .. 'depth'
local fields = redis.pcall('HLEN', key)
local depth = (type(fields) == 'number' and fields <= 2 * ARGV[7]) and redis.pcall('HGETALL', key) or nil
if depth == nil or depth.err then
  out[#out + 1] = 0
else
  out[#out + 1] = 1
  for _, value in ipairs(depth) do out[#out + 1] = value end
end
return out
