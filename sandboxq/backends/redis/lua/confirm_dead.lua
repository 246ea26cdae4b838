-- confirm_dead.lua: the old owner of cancelled jobs confirms their children dead.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 worker id, then pairs: job id, token of the ended attempt.
-- Returns: the ids whose fence this lifted (others: no fence, or another lease's; nothing
--          changed for those).
-- Upholds: design invariant 12 across a hand-over (cancel.lua, retry_failed.lua): only the owner
-- of the fenced lease, with its token, lifts the fence; a job retried meanwhile (delayed
-- until the fence) becomes claimable now instead of when the old lease would have expired,
-- ready from now (its wait is counted from here) and behind the jobs already waiting.

local worker = ARGV[5]
local lifted = {}
local woken = 0
local now
for id, token in lease_pairs(6) do
  local key = PREFIX .. id
  local f = hmget(key, 'fence_owner', 'fence_token', 'state', 'priority')
  if f and f[1] == worker and f[2] == token then
    redis.call('HDEL', key, 'fence_owner', 'fence_token', 'fenced_until_ms')
    if f[3] == 'delayed' then
      now = now or now_ms()
      redis.call('ZREM', DELAYED, id)
      local seq = next_seq()
      redis.call('HSET', key, 'state', 'waiting', 'seq', int(seq), 'ready_ms', int(now))
      redis.call('ZADD', WAITING, waiting_score(f[4], seq), id)
      batch_after(id, 'delayed', now) -- batches (common.lua)
      woken = woken + 1
    end
    emit('unfenced', id)
    lifted[#lifted + 1] = id
  end
end
wake(woken)
return lifted
