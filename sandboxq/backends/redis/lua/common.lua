-- common.lua: helpers shared by every sandboxq script. scripts.py puts this file in
-- front of each script, so a script is still one atomic call with one round trip.
-- In front of this file scripts.py puts the constants generated from rules.py
-- (HISTORY_CAP, MAX_PRIORITY, DEFAULT_MAX_STALLS, PROMOTE_LIMIT, TRIM_BUDGET and the
-- stall, cancel and malformed-record texts): the memory backend reads the same ones.
--
-- KEYS, the same list in the same order for every script (keys.py: QueueKeys.script_keys).
-- All of them carry the queue's hash tag, so every script runs on one Cluster slot.
--   1 job key prefix  sq:{q}:job:  (job hash = prefix..id)
--   2 waiting ZSET    score = -priority * 2^40 + seq: highest priority first, FIFO within
--   3 delayed ZSET    score = due ms (server clock)
--   4 active ZSET     score = lease expiry ms (server clock)
--   5 completed ZSET  6 failed ZSET  7 cancelled ZSET    score = finished ms
--   8 seq counter     9 events STREAM    10 wake LIST (one entry per claimable job)
--  11 history prefix  sq:{q}:history:  (attempt records LIST = prefix..id; an id may hold
--                     ':', so no key built from an id may extend another one: keys.py)
-- ARGV 1-4, the same for every script: max events kept in the stream, jobs kept in the
-- completed set, jobs kept in the failed (and cancelled) set, max age of finished jobs ms.
-- Script-specific arguments start at ARGV[5].
--
-- Time: every timestamp is computed here from TIME (design invariant 2: the server's clock,
-- never a client's). Redis 7 replicates a script's effects, so TIME followed by writes
-- is safe on replicas and in the AOF.

local PREFIX, WAITING, DELAYED, ACTIVE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local COMPLETED, FAILED, CANCELLED = KEYS[5], KEYS[6], KEYS[7]
local SEQ, EVENTS, WAKE, HISTORY = KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local MAX_EVENTS = ARGV[1]
local RETAIN_COMPLETED, RETAIN_FAILED = tonumber(ARGV[2]), tonumber(ARGV[3])
local RETAIN_MS = tonumber(ARGV[4])

-- 2^40: with |priority| <= MAX_PRIORITY (< 2^10) and seq < 2^40, every score is below
-- 2^53 and so exact as a double
local PRIORITY_SPAN = 1099511627776
local WAKE_CAP = 1000 -- more entries than this would only wake workers with nothing to do

-- Integers go to Redis as '%d' strings: Lua's own number formatting would turn a
-- millisecond timestamp or a packed score into an exponent form and lose digits.
local function int(x)
  return string.format('%d', x)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A whole number from 0 up: tonumber() alone takes 'inf', 'nan' and '1e400', which make
-- an attempt number that never runs out of retries.
local MAX_COUNT = 9007199254740991 -- 2^53 - 1: exact as a Lua number and as JSON
local function is_count(value)
  local n = tonumber(value)
  return n ~= nil and n >= 0 and n <= MAX_COUNT and n == math.floor(n)
end

-- A counter field as a number, or `default` when it holds anything but a count.
local function count_or(value, default)
  if is_count(value) then return tonumber(value) end
  return default
end

local function clamp_priority(p)
  p = tonumber(p) or 0
  if p ~= p then return 0 end -- NaN
  if p > MAX_PRIORITY then return MAX_PRIORITY end
  if p < -MAX_PRIORITY then return -MAX_PRIORITY end
  return p
end

local function waiting_score(priority, seq)
  return int(-clamp_priority(priority) * PRIORITY_SPAN + seq)
end

local function next_seq()
  return redis.call('INCR', SEQ)
end

local function emit(kind, id, ...)
  redis.call('XADD', EVENTS, 'MAXLEN', '~', MAX_EVENTS, '*', 'kind', kind, 'job', id, ...)
end

-- Wake up to n idle workers blocked in a waiting claim (BLPOP on WAKE, backend.claim).
local function wake(n)
  if n <= 0 then return end
  n = math.min(n, WAKE_CAP)
  local entries = {}
  for i = 1, n do entries[i] = '1' end
  if redis.call('LPUSH', WAKE, unpack(entries)) > WAKE_CAP then
    redis.call('LTRIM', WAKE, 0, WAKE_CAP - 1)
  end
end

-- HMGET that survives a key of the wrong type: returns nil instead of aborting the
-- script half-way (Redis does not roll back the writes a failing script already made).
local function hmget(key, ...)
  local r = redis.pcall('HMGET', key, ...)
  if type(r) == 'table' and r.err then return nil end
  return r
end

local function short(value)
  return string.sub(tostring(value), 1, 60)
end

-- A history key of the wrong type (written by hand) would abort the script half-way,
-- after the job left the active set: the job would be lost. It holds nothing readable,
-- so it is replaced by a list that starts again.
local function append_history(id, record_json)
  local hkey = HISTORY .. id
  local n = redis.pcall('RPUSH', hkey, record_json)
  if type(n) == 'table' and n.err then
    redis.call('DEL', hkey)
    n = redis.call('RPUSH', hkey, record_json)
  end
  if n > HISTORY_CAP then
    redis.call('LTRIM', hkey, -HISTORY_CAP, -1)
  end
end

local function drop_job(id)
  redis.call('DEL', PREFIX .. id, HISTORY .. id)
end

-- Retention: keep at most `keep` jobs in a finished set and none finished RETAIN_MS or
-- more ago (rules.retention_over), deleting the trimmed jobs' hash and history, oldest
-- first (ties by id, the sorted set's order). Bounded work per call (TRIM_BUDGET);
-- every job entering the set calls it again, so the set converges.
local function trim_finished(zset, keep, now)
  local budget = TRIM_BUDGET
  local excess = redis.call('ZCARD', zset) - keep
  if excess > 0 then
    local n = math.min(excess, budget)
    local ids = redis.call('ZRANGE', zset, 0, n - 1)
    for _, id in ipairs(ids) do drop_job(id) end
    redis.call('ZREMRANGEBYRANK', zset, 0, n - 1)
    budget = budget - n
  end
  if budget > 0 then
    local ids = redis.call('ZRANGEBYSCORE', zset, '-inf', int(now - RETAIN_MS), 'LIMIT', 0, budget)
    if #ids > 0 then
      for _, id in ipairs(ids) do drop_job(id) end
      redis.call('ZREM', zset, unpack(ids))
    end
  end
end

-- Design invariant 7: a record too broken to run fails that one job with a stated cause.
-- A key of the wrong type is replaced by a hash that says why; an unreadable field
-- ('opts' or 'attempts') moves to 'bad_<field>' and gets its default, so `get` shows
-- the failure instead of raising.
local FIELD_DEFAULTS = {opts = '{}', attempts = '0'}
local function fail_malformed(id, reason, now, bad_field)
  local key = PREFIX .. id
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'hash' and kind ~= 'none' then
    redis.call('DEL', key)
  elseif bad_field then
    local value = redis.call('HGET', key, bad_field)
    if value then redis.call('HSET', key, 'bad_' .. bad_field, value) end
    redis.call('HSET', key, bad_field, FIELD_DEFAULTS[bad_field])
  end
  local err = string.format(MALFORMED_TEXT, reason)
  redis.call('ZREM', WAITING, id)
  redis.call('ZREM', DELAYED, id)
  redis.call('ZREM', ACTIVE, id)
  redis.call('HDEL', key, 'owner', 'token')
  redis.call('HSET', key, 'state', 'failed', 'outcome', 'error', 'error', err,
    'finished_ms', int(now))
  redis.call('ZADD', FAILED, int(now), id)
  emit('failed', id, 'outcome', 'error', 'error', err)
  trim_finished(FAILED, RETAIN_FAILED, now)
end

-- Why a job popped from waiting cannot be claimed (nil when it can), plus its fields.
local function claim_problem(key)
  local f = hmget(key, 'payload', 'codec', 'opts', 'attempts', 'state', 'ready_ms', 'created_ms',
    'infra_deaths')
  if not f then return 'the job key is not a hash' end
  if not f[1] and not f[2] and not f[5] then return 'the job hash is missing' end
  if not f[1] then return 'the payload field is missing' end
  if not f[2] or f[2] == '' then return 'the codec field is missing' end
  if not f[3] then return 'the opts field is missing', nil, 'opts' end
  local ok, decoded = pcall(cjson.decode, f[3])
  if not ok or type(decoded) ~= 'table' then
    return 'the opts field is not a JSON object: ' .. short(f[3]), nil, 'opts'
  end
  if f[4] and not is_count(f[4]) then
    return 'the attempts field is not a count: ' .. short(f[4]), nil, 'attempts'
  end
  if f[5] ~= 'waiting' then
    return 'state is ' .. short(f[5] or '(missing)') .. ' but the job was in the waiting set'
  end
  return nil, f
end

-- Move due delayed jobs to waiting (PROMOTE_LIMIT per call), due time first, then id.
-- A due job takes a new sequence number: it queues behind the jobs already waiting at its
-- priority. Its ready_ms was set to its due time when it was delayed.
local function promote_due(now)
  local due = redis.call('ZRANGEBYSCORE', DELAYED, '-inf', int(now), 'LIMIT', 0, PROMOTE_LIMIT)
  if #due == 0 then return end
  redis.call('ZREM', DELAYED, unpack(due))
  for _, id in ipairs(due) do
    local key = PREFIX .. id
    local f = hmget(key, 'priority')
    local seq = next_seq()
    -- a broken record still goes to waiting, where claim fails it with a stated cause
    if f and redis.call('EXISTS', key) == 1 then
      redis.call('HSET', key, 'state', 'waiting', 'seq', int(seq))
      -- a fenced retry falls due when the old lease would have run out: the fence is over
      redis.call('HDEL', key, 'fence_owner', 'fence_token', 'fenced_until_ms')
    end
    redis.call('ZADD', WAITING, waiting_score(f and f[1], seq), id)
  end
end

-- Lease up to `count` waiting jobs (design invariant 1: a fresh token per claim, owner = worker;
-- design invariant 2: expiry from the server clock). Returns a flat list of
-- id, token, payload, codec, opts, attempt, wait ms, infra deaths for each claimed job.
local function claim_jobs(worker, count, lease_ms, token_base, now)
  promote_due(now)
  local out = {}
  local n = 0
  local expiry = int(now + lease_ms)
  while n < count do
    local popped = redis.call('ZPOPMIN', WAITING)
    if #popped == 0 then break end
    local id = popped[1]
    local key = PREFIX .. id
    local problem, f, bad_field = claim_problem(key)
    if problem then
      fail_malformed(id, problem, now, bad_field)
    else
      n = n + 1
      local token = token_base .. '.' .. n
      local attempt = count_or(f[4], 0) + 1
      redis.call('HSET', key, 'state', 'active', 'owner', worker, 'token', token,
        'attempts', int(attempt))
      redis.call('ZADD', ACTIVE, expiry, id)
      emit('active', id, 'worker', worker, 'attempt', int(attempt))
      local i = #out
      out[i + 1], out[i + 2], out[i + 3] = id, token, f[1]
      out[i + 4], out[i + 5], out[i + 6] = f[2], f[3], attempt
      -- how long it waited since it was ready (enqueued, due, retried): sandboxq_wait_seconds
      out[i + 7] = int(math.max(0, now - (tonumber(f[6]) or tonumber(f[7]) or now)))
      out[i + 8] = count_or(f[8], 0) -- the worker fails it as poison at its limit
    end
  end
  -- Nothing left to claim: drop stale wake entries so idle workers block instead of
  -- waking once per entry. With delayed jobs pending, keep a few: a worker that read
  -- the next due time just before a new delayed job arrived must still wake to re-read.
  if redis.call('ZCARD', WAITING) == 0 then
    if redis.call('ZCARD', DELAYED) == 0 then
      redis.call('DEL', WAKE)
    else
      redis.call('LTRIM', WAKE, 0, 7)
    end
  end
  return out
end

-- The caller's lease is the job's current lease (design invariant 1).
local function owns(key, worker, token)
  local f = hmget(key, 'owner', 'token', 'state')
  return f ~= nil and f[1] == worker and f[2] == token and f[3] == 'active'
end

-- The (job id, token) pairs of ARGV from index `first` on, for `for id, token in ...`.
local function lease_pairs(first)
  local i = first - 2
  return function()
    i = i + 2
    if ARGV[i] ~= nil then return ARGV[i], ARGV[i + 1] end
  end
end

-- A claimed job back in line without charging its attempt (requeue, release): one
-- attempt fewer, and its old place (seq), since it was claimed first. Returns the fields
-- to HSET.
local function back_in_line(key, id)
  local f = redis.call('HMGET', key, 'attempts', 'priority', 'seq')
  redis.call('ZADD', WAITING, waiting_score(f[2], count_or(f[3], nil) or next_seq()), id)
  return 'state', 'waiting', 'attempts', int(math.max(count_or(f[1], 1) - 1, 0))
end

