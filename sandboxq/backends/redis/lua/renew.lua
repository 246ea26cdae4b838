-- renew.lua: extend the leases a worker still holds.
-- KEYS: the standard list (common.lua); uses job prefix and active.
-- ARGV: 1-4 standard; 5 worker id, 6 lease ms, then pairs: job id, token.
-- Returns: the ids that were NOT renewed (lost, recovered, cancelled or finished).
-- Upholds: design invariant 1 (only the current owner with the current token extends a lease,
-- never another owner's) and design invariant 2 (expiry = server TIME + lease). A lease that
-- expired but was not recovered yet is still the caller's, so it is extended.
-- Cost: one owner check (HMGET, ~1.7 us of server CPU) per lease; the active set is read
-- and written once per RENEW_CHUNK leases (ZMSCORE, ZADD: 1.15 us a lease, against 1.4 us
-- for a ZSCORE and a ZADD per lease). A worker renews every lease it holds each interval.

local RENEW_CHUNK = 1000 -- ids per ZMSCORE / ZADD: well inside Lua's unpack limit

local worker = ARGV[5]
local expiry = int(now_ms() + tonumber(ARGV[6]))
local lost, owned = {}, {}

-- Extend the leases of `ids` still in the active set; the others are lost.
local function extend(ids)
  local scores = redis.call('ZMSCORE', ACTIVE, unpack(ids))
  local members = {}
  for i, id in ipairs(ids) do
    if scores[i] then
      members[#members + 1] = expiry
      members[#members + 1] = id
    else
      lost[#lost + 1] = id
    end
  end
  if #members > 0 then redis.call('ZADD', ACTIVE, unpack(members)) end
end

for id, token in lease_pairs(7) do
  if owns(PREFIX .. id, worker, token) then
    owned[#owned + 1] = id
    if #owned == RENEW_CHUNK then
      extend(owned)
      owned = {}
    end
  else
    lost[#lost + 1] = id
  end
end
if #owned > 0 then extend(owned) end
return lost
