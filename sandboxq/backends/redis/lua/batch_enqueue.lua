-- batch_enqueue.lua: add one chunk of a batch's members (the batch is made by its first).
-- KEYS: the standard list (common.lua), and 12 the queue index (as enqueue.lua).
-- ARGV: 1-4 standard; 5 batch id, 6 the batch's total member count, 7 the index of this
--       chunk's first member (0: this call makes the batch), 8 then queue ('' = none),
--       9 ttl ms (how long the batch is kept once done), 10 the number of jobs, 11 the
--       jobs framed as enqueue.lua takes them (their ids are '<batch id>.<index>'), 12 the
--       batch's label after a '=' ('' = none; read by the first chunk only).
-- Returns: the number of members the batch has after this call; or an error reply, with
--          nothing of this chunk written: the batch already exists (first chunk), does not
--          exist (a later chunk whose first failed), or a member id is taken.
-- Upholds: design invariant 14: the batch's counters are kept in the same call that adds
-- its members; the chunk that brings `enqueued` to the total seals the batch (only a sealed
-- batch can be done), so a batch whose enqueue stopped part-way never sends its follow-up;
-- ids unique while retained, as enqueue.lua.

local bid, total, first = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local bkey = BATCH .. bid
local now = now_ms()
if first == 0 then
  if redis.call('EXISTS', bkey) == 1 then
    return redis.error_reply('BATCH batch ' .. bid .. ' already exists')
  end
elseif redis.call('TYPE', bkey).ok ~= 'hash' then
  return redis.error_reply('BATCH batch ' .. bid .. ' does not exist (its first chunk failed)'
    .. ' or its key holds no batch')
end

local count = tonumber(ARGV[10])
local blob = ARGV[11]
-- Every id is checked before anything is written (the frames are read twice rather than
-- kept: a table per member cost more than reading its frame again).
local pos = 1
for _ = 1, count do
  local id
  pos, id = unframe(blob, pos)
  if redis.call('EXISTS', PREFIX .. id) == 1 then
    return redis.error_reply('BATCH job id ' .. id .. ' of batch ' .. bid .. ' is taken')
  end
end

if first == 0 then -- every check passed: the batch is made with its first members
  redis.call('HSET', bkey, 'total', int(total), 'enqueued', '0', 'created_ms', int(now),
    'then', ARGV[8], 'ttl_ms', ARGV[9], 'waiting', '0', 'delayed', '0', 'active', '0',
    'completed', '0', 'failed', '0', 'cancelled', '0')
  redis.call('ZADD', BATCH_INDEX, int(now), bid)
  if ARGV[12] and ARGV[12] ~= '' then redis.call('HSET', bkey, 'label', string.sub(ARGV[12], 2)) end
end
local seq = redis.call('INCRBY', SEQ, count) - count
local waiting, delayed = 0, 0
pos = 1
for _ = 1, count do
  local id, payload, codec, opts, priority, delay, max_stalls
  pos, id, payload, codec, opts, priority, delay, max_stalls = unframe(blob, pos)
  seq = seq + 1
  local state = 'waiting'
  if delay > 0 then state = 'delayed' end
  redis.call('HSET', PREFIX .. id, 'payload', payload, 'codec', codec, 'opts', opts,
    'state', state, 'priority', int(priority), 'max_stalls', int(max_stalls),
    'seq', int(seq), 'created_ms', int(now), 'ready_ms', int(now + delay), 'batch', bid)
  if delay > 0 then
    redis.call('ZADD', DELAYED, int(now + delay), id)
    delayed = delayed + 1
  else
    redis.call('ZADD', WAITING, waiting_score(priority, seq), id)
    waiting = waiting + 1
  end
  emit('added', id)
end
-- (forged counters stay as they are: the members are in line already)
add_count(bkey, 'waiting', waiting)
add_count(bkey, 'delayed', delayed)
local enqueued = add_count(bkey, 'enqueued', count)
if enqueued == total then
  redis.call('HSET', bkey, 'sealed', '1')
  batch_check_done(bid, now)
end
wake(count)
-- pcall: the index is shared by every queue on the server, so any queue's user may damage
-- it; that costs the dashboard its discovery of this queue, never this enqueue
redis.pcall('SADD', QUEUE_INDEX, QUEUE_NAME)
return enqueued
