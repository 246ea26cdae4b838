-- batch_read.lua: a batch's counters, or its finished members after a cursor, read only
-- while the batch is kept.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 batch id; 6 'progress', then 7... the batch hash's fields to read;
--       or 6 'finished', 7 the stream cursor (an entry id, '0': from the start), 8 how many
--       entries at most.
-- Returns: {false, the fields' values (HMGET)} or {false, the XREAD reply (false: none)}
--          while the batch is kept or does not exist; {when it expired (ms), its ttl (ms)}
--          once it is past its batch_ttl_s.
-- Upholds: design invariant 14 (the user's unit is the batch): a batch past its ttl is gone
-- for every reader at once, whatever retention's sweep has deleted of it yet
-- (batch_expired), and the check and the read are one atomic call, so no read is of a
-- batch the sweep has begun on.

local bid = ARGV[5]
local expired_ms, ttl_ms = batch_expired(bid, now_ms())
if expired_ms then return {expired_ms, ttl_ms} end
if ARGV[6] == 'progress' then
  return {false, redis.call('HMGET', BATCH .. bid, unpack(ARGV, 7))}
end
return {false, redis.call('XREAD', 'COUNT', ARGV[8], 'STREAMS', BATCH_DONE .. bid, ARGV[7])}
