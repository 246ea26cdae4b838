-- recover_stalled.lua: take back jobs whose lease expired (the owner stopped renewing).
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 max jobs handled in this call (rules.RECOVER_LIMIT); 6 the infra
--       deaths at which a job fails as poison (max_infra_deaths).
-- Returns: a flat list of job id, new state ('waiting' or 'failed') pairs, the earliest
--          expiry first (ties by id).
-- Upholds: design invariant 3 (a dead worker's jobs come back: waiting again at their old place
-- in line and ready from now, or failed with a stated cause after max_stalls), design invariant 1
-- (owner and token are cleared, so the old owner's late renew or ack is rejected),
-- design invariant 2 (expiry judged by server TIME), design invariant 11 (the worker's death
-- counts against the job's infra_deaths: at the limit it fails as poison). Each stalled
-- attempt is recorded. Then finished jobs past their time go (bounded: TRIM_BUDGET).

local now = now_ms()
local max_infra = tonumber(ARGV[6])
-- expired strictly before now (rules.lease_expired)
local expired = redis.call('ZRANGEBYSCORE', ACTIVE, '-inf', '(' .. int(now),
  'LIMIT', 0, tonumber(ARGV[5]))
local out = {}
local requeued = 0
for _, id in ipairs(expired) do
  local key = PREFIX .. id
  redis.call('ZREM', ACTIVE, id)
  local f = hmget(key, 'state', 'owner', 'attempts', 'stalls', 'max_stalls', 'priority', 'seq',
    'opts')
  local current = f and f[1]
  if current == 'completed' or current == 'failed' or current == 'cancelled' then
    -- a stale entry: the job moved on (every such move leaves the set; this one did not)
  elseif current ~= 'active' then
    -- nowhere else to go: failing it is the only way it is not lost (design invariant 3)
    local why
    if not f then
      why = 'the job key is not a hash'
    elseif redis.call('EXISTS', key) == 0 then
      why = 'the job hash is missing'
    else
      why = 'state is ' .. short(current or '(missing)') .. ' while its lease was held'
    end
    fail_malformed(id, why, now, nil)
    out[#out + 1], out[#out + 2] = id, 'failed'
  else
    local stalls = count_or(f[4], 0) + 1
    local max_stalls = count_or(f[5], DEFAULT_MAX_STALLS)
    local deaths = redis.call('HINCRBY', key, 'infra_deaths', 1)
    local record = {attempt = count_or(f[3], 0), outcome = 'lease_lost', ended_ms = now}
    if f[2] then record.worker_id = f[2] end
    record.started_ms, record.pid = running_attempt(key, id, f[2])
    local state, err
    redis.call('HDEL', key, 'owner', 'token', 'claimed_ms', 'child_pid', 'child_started_ms')
    local poison = stalls <= max_stalls and deaths >= max_infra -- rules.poisoned
    if stalls > max_stalls or poison then
      state = 'failed'
      if poison then
        record.outcome = 'poison'
        err = string.format(POISON_TEXT, deaths, WORKER_DEATH_TEXT)
      else
        err = string.format(STALL_FAIL_TEXT, stalls)
      end
      redis.call('HSET', key, 'state', 'failed', 'finished_ms', int(now))
      redis.call('ZADD', FAILED, int(now), id)
      record.action = 'fail'
    else
      state = 'waiting'
      err = string.format(STALL_RETRY_TEXT, stalls, max_stalls)
      redis.call('HSET', key, 'state', 'waiting', 'ready_ms', int(now))
      -- back to its old place in line: it was claimed first, so it runs next
      redis.call('ZADD', WAITING, waiting_score(f[6], count_or(f[7], nil) or next_seq()), id)
      record.action = 'retry'
      requeued = requeued + 1
    end
    record.error = err
    redis.call('HSET', key, 'stalls', int(stalls), 'outcome', record.outcome, 'error', err)
    append_history(id, cjson.encode(record))
    emit('stalled', id, 'state', state, 'stalls', int(stalls))
    if state == 'failed' then
      emit('failed', id, 'outcome', record.outcome, 'error', err)
      trim_finished(FAILED, RETAIN_FAILED, now, id, f[8])
    end
    out[#out + 1], out[#out + 2] = id, state
    batch_after(id, 'active', now) -- batches (common.lua)
  end
end
wake(requeued)
-- retention's age rule runs here too, so a queue where nothing finishes any more still
-- lets its finished jobs go at their time (common.lua: expire_due, age_out)
local budget = expire_due(now, TRIM_BUDGET)
for _, finished in ipairs({COMPLETED, FAILED, CANCELLED}) do budget = age_out(finished, now, budget) end
sweep_batches(now)
return out
