-- batch_each.lua: cancel, or retry, the members of a batch from one index on.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 batch id, 6 'cancel', 'cancel_unstarted' (running members go on)
--       or 'retry', 7 first index, 8 how many
--       members (rules.BATCH_CHUNK), 9 the cancel channel (PUBLISH target).
-- Returns: {members acted on (a cancel's last call adds those its claims cancelled for it,
--          claim_jobs), the batch's member count} (-1 as the count: no such batch; -4: it
--          expired, then {0, -4, when it expired, its ttl ms}: batch_expired).
-- Upholds: what cancel.lua and retry_failed.lua uphold, member by member (a running
-- member's lease is revoked and fenced; a waiting one never starts); the batch's counters
-- follow every move of the call at its end, in the same atomic call (batch_members_moved).

local bid, action = ARGV[5], ARGV[6]
local first, n = tonumber(ARGV[7]), tonumber(ARGV[8])
local f = redis.call('HMGET', BATCH .. bid, 'total', 'enqueued')
if not f[1] then return {0, -1} end
local last = math.max(count_or(f[1], 0), count_or(f[2], 0))
local now = now_ms() -- one instant for the whole call, as for an atomic move
-- an expired batch is being deleted: a retry would reopen what is left of it
local expired_ms, ttl_ms = batch_expired(bid, now)
if expired_ms then return {0, -4, expired_ms, ttl_ms} end
-- A cancel goes in calls of BATCH_CHUNK members, and a worker claims between two of them:
-- the batch is marked from the first call on ('cancelling': how many members claims have
-- cancelled meanwhile), and a claim cancels its members instead of starting them (a
-- worker busy with short jobs ran and lost 1,159 of 20,000 that way). The last call
-- counts those as its own and lifts the mark; a retry lifts it too.
local bkey, by_claims = BATCH .. bid, 0
if action == 'retry' then
  if first == 0 then redis.call('HDEL', bkey, 'cancelling') end
elseif first + n < last then
  if redis.call('HEXISTS', bkey, 'cancelling') == 0 then
    redis.call('HSET', bkey, 'cancelling', '0')
  end
else
  by_claims = count_or(redis.call('HGET', bkey, 'cancelling'), 0)
  redis.call('HDEL', bkey, 'cancelling')
end
local acted, moves = 0, {}
for i = first, math.min(last, first + n) - 1 do
  local id = bid .. '.' .. i
  local from, to, opts
  if redis.pcall('HGET', PREFIX .. id, 'batch') ~= bid then
    -- not a member (an enqueue stopped before it, and the id is another job's)
  elseif action == 'retry' then
    from, to = retry_move(id, now)
    if from then member_reopened(bid, id) end
  elseif action == 'cancel' or redis.call('HGET', PREFIX .. id, 'state') ~= 'active' then
    from, opts = cancel_move(id, ARGV[9], now)
    if from then
      to = 'cancelled'
      keep_until(CANCELLED, now, id, opts)
      member_ended(bid, id, to)
    end
  end
  if from then
    acted = acted + 1
    local move = from .. ' ' .. to
    moves[move] = (moves[move] or 0) + 1
  end
end
if acted > 0 then
  -- What cancel_job and retry_job do per job, once for all: the batch's counters and its
  -- done check, then retention for what was cancelled (as finish.lua does it), or a wake
  -- for what was put back. Server time per waiting member cancelled (20,000, 3 alternated
  -- runs): 44-54 us per job, 24-27 us once for all.
  batch_members_moved(bid, moves, now)
  if action == 'retry' then
    wake(acted)
  else
    retain(CANCELLED, RETAIN_FAILED, now, acted)
  end
end
return {acted + by_claims, last}
