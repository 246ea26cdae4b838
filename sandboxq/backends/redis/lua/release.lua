-- release.lua: hand back jobs a worker claimed but never started.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 worker id, then pairs: job id, token.
-- Returns: the ids that were NOT released (the caller no longer owns them).
-- Upholds: design invariant 1 (owner + token checked) and design invariant 9 (a worker that stops hands
-- back what it had not started: waiting again at its old place in line, the attempt
-- uncharged and no attempt record, because nothing ran).

local worker = ARGV[5]
local kept = {}
local released = 0
for i = 6, #ARGV, 2 do
  local id = ARGV[i]
  local key = PREFIX .. id
  if owns(key, worker, ARGV[i + 1]) then
    redis.call('ZREM', ACTIVE, id)
    local f = redis.call('HMGET', key, 'attempts', 'priority', 'seq')
    local seq = tonumber(f[3]) or next_seq()
    redis.call('HDEL', key, 'owner', 'token')
    redis.call('HSET', key, 'state', 'waiting', 'attempts', int(math.max((tonumber(f[1]) or 1) - 1, 0)))
    redis.call('ZADD', WAITING, waiting_score(f[2], seq), id)
    emit('released', id)
    released = released + 1
  else
    kept[#kept + 1] = id
  end
end
wake(released)
return kept
