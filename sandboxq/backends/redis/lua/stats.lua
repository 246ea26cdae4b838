-- stats.lua: the numbers of many queues in one call, for the exporter and `sandboxq queues`
-- (read-only; sent alone, without common.lua: it reads many queues, not one).
-- KEYS: per queue (or, with none, ARGV from 3 on: see below), in the order of stats.py
--       _stats_keys: waiting, delayed, active, completed, failed, cancelled (the six
--       state sets), workers (SET), seq, then two prefixes: job hashes (prefix..id) and
--       worker records (prefix..worker id).
-- ARGV: 1 the number of keys per queue (10); 2 the most registered workers read per queue.
-- Returns: the server time ms, then per queue either one error text (a key of the wrong
--          type: that queue alone is damaged) or 10 integers: six counts, the head of
--          waiting's ready ms (-1: nothing waits; 0: unknown), workers registered, live
--          workers among those read, and 1 if the queue was ever used (seq or workers
--          exist).
-- Upholds: bounded work per queue whatever it holds (ZCARD, one head, at most ARGV[2]
-- workers read, one EXISTS each): a registry padded by hand cannot stall a scrape, and a
-- damaged queue costs only its own row (redis.pcall), never the scrape.

local per, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
-- On a Cluster the keys come after those two in ARGV instead: declared, keys of several
-- slots would be refused (CROSSSLOT), while a script without a shebang may read keys of
-- every slot its node serves. A key of a slot served elsewhere (moved since the caller
-- read the slot map) fails its queue's row: "... non local key ...".
local KEYS = KEYS
if #KEYS == 0 then
  KEYS = {}
  for i = 3, #ARGV do KEYS[#KEYS + 1] = ARGV[i] end
end
local t = redis.call('TIME')
local out = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}

local function call(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then error(reply.err, 0) end
  return reply
end

local function queue_row(base)
  local row = {}
  for i = 0, 5 do row[#row + 1] = call('ZCARD', KEYS[base + i]) end
  local head = call('ZRANGE', KEYS[base], 0, 0)
  local ready = -1
  if #head > 0 then
    ready = 0
    local job = redis.pcall('HMGET', KEYS[base + 8] .. head[1], 'ready_ms', 'created_ms')
    if type(job) == 'table' and not job.err then
      ready = tonumber(job[1] or '') or tonumber(job[2] or '') or 0
    end
  end
  row[#row + 1] = ready
  local registered = call('SCARD', KEYS[base + 6])
  local live = 0
  if registered > 0 then
    local members = call('SSCAN', KEYS[base + 6], 0, 'COUNT', cap)[2]
    for i = 1, math.min(#members, cap) do
      live = live + redis.call('EXISTS', KEYS[base + 9] .. members[i])
    end
  end
  row[#row + 1] = registered
  row[#row + 1] = live
  local used = 0
  for i = 1, 6 do if row[i] > 0 then used = 1 end end -- jobs: used, no need to ask
  if used == 0 and (registered > 0 or redis.call('EXISTS', KEYS[base + 7]) == 1) then used = 1 end
  row[#row + 1] = used
  return row
end

for base = 1, #KEYS, per do
  local ok, row = pcall(queue_row, base)
  if ok then
    for i = 1, #row do out[#out + 1] = row[i] end
  else
    out[#out + 1] = tostring(row)
  end
end
return out
