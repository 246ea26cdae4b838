-- progress.lua: store the latest progress of a running job.
-- KEYS: the standard list (common.lua); uses job prefix and events.
-- ARGV: 1-4 standard; 5 worker id, 6 job id, 7 token, 8 fraction, 9 message ('' = none).
-- Returns: 1 stored, 0 the caller no longer owns the job (nothing changed).
-- Upholds: design invariant 1 (only the current owner + token writes to the job).

local id = ARGV[6]
local key = PREFIX .. id
if not owns(key, ARGV[5], ARGV[7]) then return 0 end
redis.call('HSET', key, 'progress', ARGV[8])
if ARGV[9] ~= '' then
  redis.call('HSET', key, 'progress_message', ARGV[9])
  emit('progress', id, 'fraction', ARGV[8], 'message', ARGV[9])
else
  redis.call('HDEL', key, 'progress_message')
  emit('progress', id, 'fraction', ARGV[8])
end
return 1
