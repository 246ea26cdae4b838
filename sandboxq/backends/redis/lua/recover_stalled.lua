-- recover_stalled.lua: take back jobs whose lease expired (the owner stopped renewing).
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 max jobs handled in this call.
-- Returns: a flat list of job id, new state ('waiting' or 'failed') pairs.
-- Upholds: invariant 3 (a dead worker's jobs come back: waiting again, or failed with a
-- stated cause after max_stalls), invariant 1 (owner and token are cleared, so the old
-- owner's late renew or ack is rejected), invariant 2 (expiry judged by server TIME).

local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', ACTIVE, '-inf', '(' .. int(now),
  'LIMIT', 0, tonumber(ARGV[5]))
local out = {}
local requeued = 0
for _, id in ipairs(expired) do
  local key = PREFIX .. id
  redis.call('ZREM', ACTIVE, id)
  local f = hmget(key, 'state', 'owner', 'attempts', 'stalls', 'max_stalls', 'priority', 'seq')
  if not f or not f[1] then
    fail_malformed(id, f and 'the job hash is missing' or 'the job key is not a hash', now, nil)
    out[#out + 1], out[#out + 2] = id, 'failed'
  elseif f[1] == 'active' then
    local stalls = (tonumber(f[4]) or 0) + 1
    local max_stalls = tonumber(f[5]) or 1
    local record = {attempt = tonumber(f[3]) or 0, outcome = 'lease_lost', ended_ms = now}
    if f[2] then record.worker_id = f[2] end
    local state, err
    redis.call('HDEL', key, 'owner', 'token')
    if stalls > max_stalls then
      state = 'failed'
      err = 'stalled ' .. stalls .. ' times: the worker holding its lease stopped renewing it'
      redis.call('HSET', key, 'state', 'failed', 'finished_ms', int(now))
      redis.call('ZADD', FAILED, int(now), id)
      record.action = 'fail'
    else
      state = 'waiting'
      err = 'lease expired (stall ' .. stalls .. ' of at most ' .. max_stalls
        .. '): the worker holding it stopped renewing it'
      redis.call('HSET', key, 'state', 'waiting')
      -- back to its old place in line: it was claimed first, so it runs next
      redis.call('ZADD', WAITING, waiting_score(f[6], tonumber(f[7]) or next_seq()), id)
      record.action = 'retry'
      requeued = requeued + 1
    end
    record.error = err
    redis.call('HSET', key, 'stalls', int(stalls), 'outcome', 'lease_lost', 'error', err)
    append_history(id, cjson.encode(record))
    emit('stalled', id, 'state', state, 'stalls', int(stalls))
    if state == 'failed' then
      emit('failed', id, 'outcome', 'lease_lost', 'error', err)
      trim_finished(FAILED, RETAIN_FAILED, now)
    end
    out[#out + 1], out[#out + 2] = id, state
  end
  -- any other state: a stale entry in active (the job moved on); dropping it is the fix
end
wake(requeued)
return out
