-- release.lua: hand back jobs a worker claimed but never started.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 worker id, then pairs: job id, token.
-- Returns: the ids that were NOT released (the caller no longer owns them).
-- Upholds: design invariants 1 (owner + token checked) and 9 (a worker that stops hands
-- back what it had not started: waiting again at its old place in line, the attempt
-- uncharged and no attempt record, because nothing ran).

local worker = ARGV[5]
local kept = {}
local released = 0
for id, token in lease_pairs(6) do
  local key = PREFIX .. id
  if owns(key, worker, token) then
    redis.call('ZREM', ACTIVE, id)
    redis.call('HDEL', key, 'owner', 'token', 'claimed_ms', 'child_pid', 'child_started_ms')
    redis.call('HSET', key, back_in_line(key, id, false))
    emit('released', id)
    batch_after(id, 'active', 0) -- batches (common.lua): back to waiting, never done here
    released = released + 1
  else
    kept[#kept + 1] = id
  end
end
wake(released)
return kept
