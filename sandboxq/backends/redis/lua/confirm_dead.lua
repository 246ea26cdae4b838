-- confirm_dead.lua: the old owner of cancelled jobs confirms their children dead.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 worker id, then pairs: job id, token of the ended attempt.
-- Returns: the ids whose fence this lifted.
-- Upholds: design invariant 12 across a hand-over (cancel.lua, retry_failed.lua): only the owner
-- of the fenced lease, with its token, lifts the fence; a job retried meanwhile (delayed
-- until the fence) becomes claimable now instead of when the old lease would have expired.

local worker = ARGV[5]
local lifted = {}
local woken = 0
for i = 6, #ARGV, 2 do
  local id = ARGV[i]
  local key = PREFIX .. id
  local f = hmget(key, 'fence_owner', 'fence_token', 'state', 'priority')
  if f and f[1] == worker and f[2] == ARGV[i + 1] then
    redis.call('HDEL', key, 'fence_owner', 'fence_token', 'fenced_until_ms')
    if f[3] == 'delayed' then
      redis.call('ZREM', DELAYED, id)
      local seq = next_seq()
      redis.call('HSET', key, 'state', 'waiting', 'seq', int(seq))
      redis.call('ZADD', WAITING, waiting_score(f[4], seq), id)
      woken = woken + 1
    end
    emit('unfenced', id)
    lifted[#lifted + 1] = id
  end
end
wake(woken)
return lifted
