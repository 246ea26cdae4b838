-- read_job.lua: one job's record and attempt history for a reader, bounded in size.
-- KEYS: the standard list (common.lua); uses the job and history prefixes.
-- ARGV: 1-4 standard; 5 job id; 6 the most bytes of one field or attempt record a reader
--       takes in; 7 how many attempt records (the newest); 8... the hash fields to read.
-- Returns: {type of the job key, type of the history key, length of the history,
--           {size of each field}, {each field's value; false if absent or over the cap},
--           {the newest attempt records; an integer (its size) for one over the cap},
--           {the lease's expiry ms, the owner's registry record (false if absent or over
--           the cap)} for an active job, else {}}
--           Only the types when the job key is not a hash.
-- Upholds: design invariant 13 (readers trust nothing in Redis): a record someone rewrote by
-- hand costs a reader at most the cap per field, however large it was made; and the
-- whole read is one atomic snapshot in one round trip.

local id = ARGV[5]
local key, hkey = PREFIX .. id, HISTORY .. id
local cap, keep = tonumber(ARGV[6]), tonumber(ARGV[7])
local kind = redis.call('TYPE', key)['ok']
local hkind = redis.call('TYPE', hkey)['ok']
if kind ~= 'hash' then
  return {kind, hkind}
end
local sizes, values = {}, {}
for i = 8, #ARGV do
  local size = redis.call('HSTRLEN', key, ARGV[i])
  sizes[#sizes + 1] = size
  if size > cap then
    values[#values + 1] = false
  else
    values[#values + 1] = redis.call('HGET', key, ARGV[i])
  end
end
local total, history = 0, {}
if hkind == 'list' then
  total = redis.call('LLEN', hkey)
  for _, entry in ipairs(redis.call('LRANGE', hkey, -keep, -1)) do
    if #entry > cap then
      history[#history + 1] = #entry
    else
      history[#history + 1] = entry
    end
  end
end
-- the attempt running now: the history holds only those that ended
local running = {}
if redis.call('HGET', key, 'state') == 'active' then
  local owner = redis.call('HGET', key, 'owner')
  local expiry = redis.call('ZSCORE', ACTIVE, id)
  local record = false
  if owner then
    local wkey = QUEUE_BASE .. 'worker:' .. owner
    -- MGET: what a reader may run on the registry (acl.py); a record that is no string
    -- or is over the cap is not read
    if redis.call('TYPE', wkey)['ok'] == 'string' and redis.call('STRLEN', wkey) <= cap then
      record = redis.call('MGET', wkey)[1]
    end
  end
  running = {expiry or false, record}
end
return {kind, hkind, total, sizes, values, history, running}
