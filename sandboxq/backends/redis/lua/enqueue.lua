-- enqueue.lua: add new jobs, skipping ids that already exist.
-- KEYS: the standard list (common.lua); uses job prefix, waiting, delayed, seq, events, wake,
--       and 12 the queue index (keys.py: INDEX, or on a Cluster the queue's slot's).
-- ARGV: 1-4 standard; 5 the number of jobs; 6 the jobs, framed back to back (one argument
--       instead of seven per job: argument encoding was most of the cost of a big batch).
--       Each job is a big-endian header  >I2 id length, I4 payload length, I2 codec length,
--       I4 opts length, i2 priority (within +-MAX_PRIORITY), i8 delay ms (rules.ms; 0:
--       waiting now), I2 max_stalls  followed by the id, payload, codec and opts bytes
--       (enqueue.py: ENQUEUE_HEADER and frame_job write the layout; rules.job_options has
--       checked the options and priority).
-- Returns: one integer per job, in order: 1 created, 0 the id already existed.
-- Upholds: ids are unique while retained (a duplicate never overwrites a live job, and
-- changes nothing but using up a sequence number); due times come from the server clock
-- (design invariant 2), ready_ms is when the job becomes claimable (now, or its due time); every
-- new job, waiting or delayed, pushes a wake entry so an idle worker notices it within
-- milliseconds without polling (a delayed one re-reads the next due time); the queue is
-- in the index once this returns, so readers find it without a SCAN.

local now = now_ms()
local count = tonumber(ARGV[5])
local blob = ARGV[6]
local seq = redis.call('INCRBY', SEQ, count) - count
local created = {}
local added = 0
local pos = 1
for j = 1, count do
  local id, payload, codec, opts, priority, delay, max_stalls
  pos, id, payload, codec, opts, priority, delay, max_stalls = unframe(blob, pos)
  local key = PREFIX .. id
  seq = seq + 1
  if redis.call('EXISTS', key) == 1 then
    created[j] = 0
  else
    local state = 'waiting'
    if delay > 0 then state = 'delayed' end
    redis.call('HSET', key, 'payload', payload, 'codec', codec, 'opts', opts, 'state', state,
      'priority', int(priority), 'max_stalls', int(max_stalls), 'seq', int(seq),
      'created_ms', int(now), 'ready_ms', int(now + delay))
    if delay > 0 then
      redis.call('ZADD', DELAYED, int(now + delay), id)
    else
      redis.call('ZADD', WAITING, waiting_score(priority, seq), id)
    end
    emit('added', id)
    added = added + 1
    created[j] = 1
  end
end
wake(added)
-- pcall: the index is shared by every queue on the server, so any queue's user may damage
-- it; that costs the dashboard its discovery of this queue, never this enqueue
redis.pcall('SADD', QUEUE_INDEX, QUEUE_NAME)
return created
