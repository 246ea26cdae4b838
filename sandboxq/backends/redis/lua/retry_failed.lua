-- retry_failed.lua: put a failed or cancelled job back to waiting, attempts reset.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 job id.
-- Returns: 1 requeued, 0 unknown or not failed/cancelled.
-- Upholds: invariant 3 (the job's history is kept; only its counters restart) and the
-- unique-id rule (the same record is reused, never duplicated).

local id = ARGV[5]
local key = PREFIX .. id
local f = hmget(key, 'state', 'priority')
if not f or (f[1] ~= 'failed' and f[1] ~= 'cancelled') then return 0 end
redis.call('ZREM', FAILED, id)
redis.call('ZREM', CANCELLED, id)
redis.call('HDEL', key, 'finished_ms', 'outcome', 'error', 'result', 'owner', 'token',
  'progress', 'progress_message')
local seq = next_seq()
redis.call('HSET', key, 'state', 'waiting', 'attempts', '0', 'stalls', '0', 'seq', int(seq),
  'ready_ms', int(now_ms()))
redis.call('ZADD', WAITING, waiting_score(f[2], seq), id)
emit('retried', id, 'manual', '1')
wake(1)
return 1
