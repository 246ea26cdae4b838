-- renew.lua: extend the leases a worker still holds.
-- KEYS: the standard list (common.lua); uses job prefix and active.
-- ARGV: 1-4 standard; 5 worker id, 6 lease ms, then pairs: job id, token.
-- Returns: the ids that were NOT renewed (lost, recovered, cancelled or finished).
-- Upholds: design invariant 1 (only the current owner with the current token extends a lease,
-- never another owner's) and design invariant 2 (expiry = server TIME + lease). A lease that
-- expired but was not recovered yet is still the caller's, so it is extended.

local worker = ARGV[5]
local expiry = int(now_ms() + tonumber(ARGV[6]))
local lost = {}
for id, token in lease_pairs(7) do
  if owns(PREFIX .. id, worker, token) and redis.call('ZSCORE', ACTIVE, id) then
    redis.call('ZADD', ACTIVE, expiry, id)
  else
    lost[#lost + 1] = id
  end
end
return lost
