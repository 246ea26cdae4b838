-- finish.lua: end the caller's attempts (complete / retry / fail / requeue), then claim
-- up to `claim` more jobs: one round trip acks every attempt that ended and refills the
-- slots they free (steady state: one round trip per job, fewer under load).
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 worker id, 6 claim count, 7 lease ms, 8 token base, 9 N acks,
--       then 10 fields per ack: job id, token, action, attempt record JSON, outcome,
--       error ('' = none), has result ('1'/'0'), result bytes, retry delay ms, what
--       died under the attempt ('' = nothing: else the job's infra_deaths goes up by
--       one); then replay_of: the token base of an earlier call whose reply was lost
--       ('' = none).
-- Returns: {N, accepted_1 .. accepted_N (1 / 0; 3: accepted, and it made a batch done whose
--          follow-up could not be sent), then CLAIM_ROW entries per claimed job as in
--          claim.lua}. A single rejected ack claims nothing ("nothing changed"). With
--          replay_of, the jobs still leased to the worker under tokens "<replay_of>.<n>"
--          come first among the claimed (a scan of the active set: only on that rare path).
-- Retention (common.lua: keep_until per job, retain once per finished set for all of the
-- call's jobs) runs after every ack, before the claim.
-- Upholds: design invariant 1 (only the current owner + token may end an attempt: a late ack
-- after recovery or cancellation is rejected and changes nothing), design invariant 3 (every job
-- leaves active for a stated state; history keeps the attempt), bounded memory (retention),
-- design invariant 11 (a helper of the pool that died under the attempt counts against the
-- job's infra_deaths; the worker, which read the count with its claim, fails it as poison at
-- its limit).

local worker = ARGV[5]
local now = now_ms()
local FIELDS = 10
-- jobs that entered each finished set: retention runs once per set after every ack
local entered = {[COMPLETED] = 0, [FAILED] = 0}

local function finish_one(base)
  local id, token, action = ARGV[base], ARGV[base + 1], ARGV[base + 2]
  local record, outcome, err = ARGV[base + 3], ARGV[base + 4], ARGV[base + 5]
  local has_result, result, delay = ARGV[base + 6], ARGV[base + 7], tonumber(ARGV[base + 8])
  local infra = ARGV[base + 9]
  local key = PREFIX .. id
  -- its batch, options (its own time to live) and codec read in the same call: one per job
  local f = owns(key, worker, token, 'batch', 'opts', 'codec')
  if not f then return 0 end
  local to -- the state it goes to
  -- the worker read the count with its claim and decided requeue or poison itself
  if infra ~= '' then redis.call('HINCRBY', key, 'infra_deaths', 1) end
  redis.call('ZREM', ACTIVE, id)
  -- a completed job's sole attempt goes in its hash (common.lua: sole_attempt)
  local sole = action == 'complete' and sole_attempt(record, worker, outcome)
  if not sole then append_history(id, record) end
  -- one HDEL and one HSET per branch: every call inside a script costs a few microseconds
  local gone = {'owner', 'token', 'claimed_ms', 'child_pid', 'child_started_ms'}
  if err == '' then gone[5] = 'error' end -- else the new error replaces it below
  if action == 'complete' or action == 'fail' then
    -- its place in line is no use once finished (a manual retry sets both again:
    -- retry_job), and each field costs a retained job's hash bytes
    gone[#gone + 1], gone[#gone + 2] = 'seq', 'ready_ms'
  end
  if action == 'complete' then
    -- nor, once completed for good, are its priority and stall limit, and the codec and
    -- options that hold their defaults (readers take an absent one as its default:
    -- records.job_info): a retained job's hash stays in a smaller allocation
    gone[#gone + 1], gone[#gone + 2] = 'priority', 'max_stalls'
    if f[5] == '{}' then gone[#gone + 1] = 'opts' end
    if f[6] == 'json' then gone[#gone + 1] = 'codec' end
  end
  redis.call('HDEL', key, unpack(gone))
  local fields = {'outcome', outcome}
  if err ~= '' then fields[3], fields[4] = 'error', err end
  if sole then
    for _, v in ipairs(sole) do fields[#fields + 1] = v end
  end
  local function set(...)
    for _, v in ipairs({...}) do fields[#fields + 1] = v end
    redis.call('HSET', key, unpack(fields))
  end

  if action == 'complete' then
    to = 'completed'
    if has_result == '1' then
      set('state', 'completed', 'finished_ms', int(now), 'result', result)
    else
      set('state', 'completed', 'finished_ms', int(now))
    end
    redis.call('ZADD', COMPLETED, int(now), id)
    emit('completed', id, 'outcome', outcome)
    keep_until(COMPLETED, now, id, f[5])
    entered[COMPLETED] = entered[COMPLETED] + 1
  elseif action == 'fail' then
    to = 'failed'
    set('state', 'failed', 'finished_ms', int(now))
    redis.call('ZADD', FAILED, int(now), id)
    emit('failed', id, 'outcome', outcome, 'error', err)
    keep_until(FAILED, now, id, f[5])
    entered[FAILED] = entered[FAILED] + 1
  elseif action == 'retry' then
    to = delay > 0 and 'delayed' or 'waiting'
    if delay > 0 then
      set('state', 'delayed', 'ready_ms', int(now + delay))
      redis.call('ZADD', DELAYED, int(now + delay), id)
    else
      local seq = next_seq()
      set('state', 'waiting', 'seq', int(seq), 'ready_ms', int(now))
      redis.call('ZADD', WAITING, waiting_score(redis.call('HGET', key, 'priority'), seq), id)
    end
    emit('retried', id, 'outcome', outcome, 'error', err, 'delay_ms', int(delay))
    wake(1)
  else
    -- requeue: the attempt is not charged, and the job keeps its place in line
    to = 'waiting'
    set(back_in_line(key, id, true))
    emit('requeued', id, 'outcome', outcome)
    wake(1)
  end
  -- batches (common.lua): counters, done, the follow-up; 3: accepted, but the batch this
  -- made done could not send its follow-up (the batch's then_error says why)
  if f[4] and batch_move(f[4], id, 'active', to, now) then return 3 end
  return 1
end

local n = tonumber(ARGV[9])
local replay_of = ARGV[10 + n * FIELDS] or ''
local out = {n}
local replayed = {}
if replay_of ~= '' then
  local prefix = replay_of .. '.'
  for _, id in ipairs(redis.call('ZRANGE', ACTIVE, 0, -1)) do
    local f = hmget(PREFIX .. id, 'owner', 'token', 'payload', 'codec', 'opts', 'attempts',
      'infra_deaths', 'uncharged', 'created_ms')
    if f and f[1] == worker and f[2] and string.sub(f[2], 1, #prefix) == prefix then
      local i, number = #replayed, count_or(f[6], 1)
      replayed[i + 1], replayed[i + 2], replayed[i + 3] = id, f[2], f[3]
      replayed[i + 4], replayed[i + 5] = f[4], f[5]
      replayed[i + 6] = math.max(1, number - count_or(f[8], 0))
      replayed[i + 7] = -1 -- no wait to report: it was measured when first claimed
      replayed[i + 8] = count_or(f[7], 0)
      replayed[i + 9] = number
      replayed[i + 10] = int(math.max(0, now - (tonumber(f[9]) or now)))
    end
  end
end
for i = 1, n do
  local action = ARGV[9 + (i - 1) * FIELDS + 3]
  if action ~= 'complete' and action ~= 'fail' and action ~= 'retry' and action ~= 'requeue' then
    return redis.error_reply('unknown finish action ' .. action)
  end
end
local accepted = 0
for i = 1, n do
  local ok = finish_one(10 + (i - 1) * FIELDS)
  out[#out + 1] = ok
  accepted = accepted + ok
end
if entered[COMPLETED] > 0 then retain(COMPLETED, RETAIN_COMPLETED, now, entered[COMPLETED]) end
if entered[FAILED] > 0 then retain(FAILED, RETAIN_FAILED, now, entered[FAILED]) end
for i = 1, #replayed do out[#out + 1] = replayed[i] end
local count = tonumber(ARGV[6]) - #replayed / CLAIM_ROW
if count > 0 and not (n == 1 and accepted == 0) then
  local claimed = claim_jobs(worker, count, tonumber(ARGV[7]), ARGV[8], now)
  for i = 1, #claimed do out[#out + 1] = claimed[i] end
end
return out
