-- retry_failed.lua: put a failed or cancelled job back in line, attempts reset.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 job id.
-- Returns: 1 put back (waiting, or delayed while fenced), 0 unknown or not failed/cancelled.
-- Upholds: design invariant 3 (the job's history is kept; only its counters restart), the
-- unique-id rule (the same record is reused, never duplicated) and design invariant 12 across a
-- hand-over: a job cancelled while active whose owner has not confirmed its child dead
-- (confirm_dead.lua) is fenced: it goes to delayed, due when the old lease would have run
-- out, so it cannot start anywhere while the cancelled attempt may still run.

local id = ARGV[5]
local key = PREFIX .. id
local f = hmget(key, 'state', 'priority', 'fence_token', 'fenced_until_ms')
if not f or (f[1] ~= 'failed' and f[1] ~= 'cancelled') then return 0 end
local now = now_ms()
redis.call('ZREM', FAILED, id)
redis.call('ZREM', CANCELLED, id)
redis.call('HDEL', key, 'finished_ms', 'outcome', 'error', 'result', 'owner', 'token',
  'progress', 'progress_message')
local until_ms = tonumber(f[4])
if f[3] and until_ms and not (until_ms < now) then -- fenced (rules.fence_lifted)
  -- due, and so ready, the first millisecond the fence is lifted
  redis.call('HSET', key, 'state', 'delayed', 'attempts', '0', 'stalls', '0',
    'infra_deaths', '0', 'ready_ms', int(until_ms + 1))
  redis.call('ZADD', DELAYED, int(until_ms + 1), id)
  emit('retried', id, 'manual', '1', 'fenced_until_ms', int(until_ms))
  wake(1) -- an idle worker re-reads the next due time
  return 1
end
redis.call('HDEL', key, 'fence_owner', 'fence_token', 'fenced_until_ms')
local seq = next_seq()
redis.call('HSET', key, 'state', 'waiting', 'attempts', '0', 'stalls', '0',
  'infra_deaths', '0', 'seq', int(seq), 'ready_ms', int(now))
redis.call('ZADD', WAITING, waiting_score(f[2], seq), id)
emit('retried', id, 'manual', '1')
wake(1)
return 1
