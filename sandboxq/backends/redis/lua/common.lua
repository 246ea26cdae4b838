-- common.lua: helpers shared by every sandboxq script. scripts.py makes one Redis function
-- library of the scripts: the constants generated from rules.py (HISTORY_CAP, MAX_PRIORITY,
-- DEFAULT_MAX_STALLS, PROMOTE_LIMIT, TRIM_BUDGET, BATCH_TTL_MS and the stall, cancel and
-- malformed-record texts: the memory backend reads the same ones), then this file, then
-- each script as the body of one registered function, which starts with bind(keys, argv).
-- The library's top level runs once, when it is loaded, so these helpers are defined once
-- per server, not on every call (15 us of server CPU per call when each script carried
-- them: redis_cost_bench). A call is still one atomic FCALL with one round trip.
--
-- KEYS, the same list in the same order for every script (keys.py: QueueKeys.script_keys).
-- All of them carry the queue's hash tag, so every script runs on one Cluster slot.
--   1 job key prefix  sq:{q}:job:  (job hash = prefix..id)
--   2 waiting ZSET    score = -priority * 2^40 + seq: highest priority first, FIFO within
--   3 delayed ZSET    score = due ms (server clock)
--   4 active ZSET     score = lease expiry ms (server clock)
--   5 completed ZSET  6 failed ZSET  7 cancelled ZSET    score = finished ms
--   8 seq counter     9 events STREAM    10 wake LIST (one entry per claimable job)
--  11 history prefix  sq:{q}:history:  (attempt records LIST = prefix..id, but for a
--                     completed job's sole attempt: sole_attempt; an id may hold ':', so
--                     no key built from an id may extend another one: keys.py)
-- ARGV 0-4, the same for every script: the queue index, sq:queues (Cluster: its slot's
-- sq:queues:{tag}), where enqueues and a batch's follow-up register a queue; bind takes it
-- off, so what follows is ARGV 1-4. It is not among the KEYS: the index is shared by every
-- queue, and a queue's ACL user may only add to it (acl.py, through a selector of its own),
-- while the ACL checks every key named at a script's call against one set of rights. Then
-- max events kept in the stream, jobs kept in the completed set, jobs kept in the failed
-- (and cancelled) set, and how long a finished job is kept, ms: "<completed> <failed and
-- cancelled>" (a job's own option wins: ttl_ms). Script-specific arguments start at ARGV[5].
--
-- Time: every timestamp is computed here from TIME (design invariant 2: the server's clock,
-- never a client's). Redis 7 replicates a function's effects, so TIME followed by writes
-- is safe on replicas and in the AOF.

-- The call's keys and arguments, and the names derived from them. Set by bind at the start
-- of every call: a function runs to its end before any other call starts, so no call sees
-- another's. KEYS and ARGV keep the names scripts have in EVAL.
local KEYS, ARGV
local PREFIX, WAITING, DELAYED, ACTIVE, COMPLETED, FAILED, CANCELLED
local SEQ, EVENTS, WAKE, HISTORY, QUEUE_INDEX
local MAX_EVENTS, RETAIN_COMPLETED, RETAIN_FAILED, COMPLETED_TTL_MS, FAILED_TTL_MS
local QUEUE_BASE, QUEUE_NAME, BATCH, BATCH_DONE, BATCHES, BATCH_INDEX, EXPIRY, TRIMS, GUARD
local STATE_OF, RETENTION

local function bind(keys, argv)
  KEYS, ARGV = keys, argv
  PREFIX, WAITING, DELAYED, ACTIVE = keys[1], keys[2], keys[3], keys[4]
  COMPLETED, FAILED, CANCELLED = keys[5], keys[6], keys[7]
  SEQ, EVENTS, WAKE, HISTORY = keys[8], keys[9], keys[10], keys[11]
  QUEUE_INDEX = table.remove(argv, 1)
  MAX_EVENTS = argv[1]
  RETAIN_COMPLETED, RETAIN_FAILED = tonumber(argv[2]), tonumber(argv[3])
  local completed_ttl, failed_ttl = string.match(argv[4] or '', '^(%d+) (%d+)$')
  COMPLETED_TTL_MS, FAILED_TTL_MS = tonumber(completed_ttl), tonumber(failed_ttl)
  -- the queue's other keys (batches, retention) share the job prefix without 'job:'
  QUEUE_BASE = string.sub(PREFIX, 1, #PREFIX - 4)
  QUEUE_NAME = string.match(QUEUE_BASE, '^sq:{(.*)}:$')
  BATCH, BATCH_DONE = QUEUE_BASE .. 'batch:', QUEUE_BASE .. 'bdone:'
  BATCHES, BATCH_INDEX = QUEUE_BASE .. 'batches', QUEUE_BASE .. 'batch_index'
  EXPIRY, TRIMS = QUEUE_BASE .. 'expiry', QUEUE_BASE .. 'trims'
  GUARD = QUEUE_BASE .. 'guard' -- never written: see guard_queue_keys
  STATE_OF = {[COMPLETED] = 'completed', [FAILED] = 'failed', [CANCELLED] = 'cancelled'}
  RETENTION = {} -- per finished set, its retention records as this call knows them
end

-- 2^40: with |priority| <= MAX_PRIORITY (< 2^10) and seq < 2^40, every score is below
-- 2^53 and so exact as a double
local PRIORITY_SPAN = 1099511627776
local WAKE_CAP = 1000 -- more entries than this would only wake workers with nothing to do

-- Integers go to Redis as '%d' strings: Lua's own number formatting would turn a
-- millisecond timestamp or a packed score into an exponent form and lose digits.
local function int(x)
  return string.format('%d', x)
end

-- A job as redis/enqueue.py frames it (ENQUEUE_HEADER), read from `pos` of `blob`: where
-- the next one starts, then its fields (enqueue.lua, batch_enqueue.lua).
local function unframe(blob, pos)
  local id_len, payload_len, codec_len, opts_len, priority, delay, max_stalls, at =
    struct.unpack('>I2I4I2I4i2i8I2', blob, pos)
  local id = string.sub(blob, at, at + id_len - 1)
  at = at + id_len
  local payload = string.sub(blob, at, at + payload_len - 1)
  at = at + payload_len
  local codec = string.sub(blob, at, at + codec_len - 1)
  at = at + codec_len
  local opts = string.sub(blob, at, at + opts_len - 1)
  return at + opts_len, id, payload, codec, opts, priority, delay, max_stalls
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

-- Adds `by` to counter `field` of hash `key`: its new value, or nil when the field holds
-- no integer (forged) and is left as it is. Never an error: the counter moves after the
-- record it counts, and a script's error undoes none of what it did before.
local function add_count(key, field, by)
  local n = redis.pcall('HINCRBY', key, field, by)
  if type(n) == 'number' then return n end
  return nil
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

-- The first step of every script that changes the queue (scripts.py adds the call after
-- bind): each queue-level key holds its type, or the call stops here having written
-- nothing. A WRONGTYPE error later on would leave the writes before it in place (a
-- script's error undoes none of them): a claim that popped a job from waiting and then
-- met an active set turned into a string left that job in no set, never to be found again.
-- The error names no key; the client names it (connection.py: _wrong_types, by TYPE).
-- Five calls, 5.1 us of server time a call (INFO commandstats, 5 rounds of 20,000 EVALSHA
-- with and without it, medians 6.8 and 1.7 us; a no-op job's life is two or three calls,
-- about 110 us): the sorted sets are checked together by one
-- ZINTER that includes GUARD, a key never written, so the intersection is known empty
-- before any member is compared. ZINTER takes a plain set too: a set put in place of a
-- sorted set by hand gets past this check.
local function guard_queue_keys()
  redis.call('ZINTER', 10, WAITING, DELAYED, ACTIVE, COMPLETED, FAILED, CANCELLED, BATCHES,
    BATCH_INDEX, EXPIRY, GUARD)
  redis.call('XLEN', EVENTS)
  redis.call('LLEN', WAKE)
  redis.call('HLEN', TRIMS)
  local seq = redis.call('GET', SEQ)
  if seq and not string.match(seq, '^%d+$') then
    error({err = 'WRONGTYPE the queue\'s key ' .. SEQ .. ' holds ' .. string.format('%q',
      string.sub(seq, 1, 40)) .. ', not a count (changed by hand?): this queue cannot work '
      .. 'until that key is repaired or deleted'})
  end
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

-- A completed job whose first attempt was its only one, with nothing to say but where and
-- when it ran and, under a memory limit, the limit and its peak (the common case), keeps
-- that record as fields of its hash instead of a history list: a key of its own costs 344
-- bytes, the fields about 40 (retention_bench). The fields' values stay short, so a small
-- hash stays in Redis's compact encoding. Readers rebuild the record (records.sole_attempt)
-- after any records the history list holds (a job a repair of its record made start its
-- numbers again may have some).
-- The record is recognised by its form, as the worker writes it (AttemptRecord's fields in
-- order, the absent ones left out), with one match instead of a JSON decode; the memory
-- figures are kept in the worker's own text (Lua would print a float anew). Returns the
-- fields to set, or nil when the record must go to the history list: anything more in it
-- (an exit code, a signal, output), another form, or not as this worker reported it.
local SOLE_FORM = '^{"attempt":1,"outcome":"([%w_]+)","action":"complete","worker_id":"([^"\\]*)",'
  .. '"pid":(%d+),"started_ms":(%d+),"ended_ms":(%d+)(.*)}$'
local SOLE_FIGURES = {'memory_limit_mb', 'peak_memory_mb'}
local function sole_attempt(record_json, worker, outcome)
  local got, by, pid, started, ended, rest = string.match(record_json, SOLE_FORM)
  if got ~= outcome or by ~= worker or #pid > 10 or #started > 15 or #ended > 15 then
    return nil
  end
  local fields = {'worker_id', by, 'pid', pid, 'started_ms', started, 'ended_ms', ended}
  for _, name in ipairs(SOLE_FIGURES) do
    local text, after = string.match(rest, '^,"' .. name .. '":([%d%.eE%+%-]+)(.*)$')
    if text then
      if #text > 24 or not tonumber(text) then return nil end
      fields[#fields + 1], fields[#fields + 2], rest = name, text, after
    end
  end
  if rest ~= '' then return nil end
  return fields
end

local function drop_job(id)
  redis.call('DEL', PREFIX .. id, HISTORY .. id)
end

-- ---- batches (design invariant 14) -------------------------------------------------------
-- A batch's keys carry the queue's hash tag too (its base is the job prefix without 'job:'):
--   sq:{q}:batch:<bid>  HASH   total (members it was made with), enqueued, sealed ('1' once
--                              all are enqueued), ttl_ms, created_ms, then (a queue name or
--                              ''), one counter per state (waiting ... cancelled); done_ms
--                              once every member is final, then_sent once the follow-up went
--   sq:{q}:bdone:<bid>  STREAM one entry per member reaching a final state: i = its index,
--                              s = c / f / x (completed, failed, cancelled), and one (s = r)
--                              per member leaving one (retried); read from 0 by any handle
--                              (Batch.as_completed)
--   sq:{q}:batches      ZSET   done batches by when they expire (done_ms + ttl_ms)
--   sq:{q}:batch_index  ZSET   every batch kept, by created_ms (listing: the dashboard)
-- A member is the job '<bid>.<index>' whose hash holds batch = <bid>. Every script that
-- moves a job from one state to another calls batch_move (directly or via batch_after) in
-- the same call, so the counters are exact at every moment and the finish that makes a
-- batch done knows it: the follow-up is decided there, once (then_sent), and enqueued on
-- the `then` queue in the same atomic call.
--   (BATCH, BATCH_DONE, BATCHES and BATCH_INDEX are set per call: bind, at the top)
local FINAL_CODE = {completed = 'c', failed = 'f', cancelled = 'x'}
local COUNTED = {waiting = true, delayed = true, active = true, completed = true,
  failed = true, cancelled = true}

-- What a key of the `then` queue must be (or not exist) for the follow-up to be written.
local THEN_KEY_TYPES = {{'job:', 'none'}, {'seq', 'string'}, {'waiting', 'zset'},
  {'events', 'stream'}, {'wake', 'list'}}

-- The follow-up job of a done batch, on queue `then_queue`: its one argument is the
-- batch's summary. Written as enqueue.lua writes a job; its id (<bid>.then) is never
-- enqueued twice while it is retained there. Returns nil when it was written (or existed),
-- else why not, also kept as the batch's then_error.
local function send_follow_up(bid, then_queue, total, c, f, x, now)
  local base = 'sq:{' .. then_queue .. '}:'
  local id = bid .. FOLLOW_UP_SUFFIX
  local key = base .. 'job:' .. id
  -- Checked before anything is written, with pcall: a user whose ACL does not reach that
  -- queue, or a key of it of the wrong type, must not abort this script half-way (Redis
  -- keeps the writes a failing script made, and the member's finish is one of them).
  local problem
  -- a queue name as models.py takes one: a forged `then` must name no keys outside a queue's
  if #then_queue > 200 or not string.match(then_queue, '^[%w_%.:%-]+$') then
    problem = 'it is not a queue name'
  end
  for _, want in ipairs(THEN_KEY_TYPES) do
    if problem then break end
    local name = base .. want[1]
    if want[1] == 'job:' then name = key end
    local kind = redis.pcall('TYPE', name)
    if type(kind) == 'table' and kind.err then
      problem = tostring(kind.err)
    elseif type(kind) == 'table' and kind.ok then
      kind = kind.ok
    end
    if not problem and want[1] == 'job:' and kind == 'hash' then return nil end -- sent before
    if not problem and kind ~= 'none' and kind ~= want[2] then
      problem = 'key ' .. name .. ' is a ' .. tostring(kind) .. ', not a ' .. want[2]
    end
  end
  if problem then
    problem = string.sub('the follow-up to queue ' .. then_queue .. ' was not sent: ' ..
      problem, 1, 300)
    redis.call('HSET', BATCH .. bid, 'then_error', problem)
    return problem
  end
  local summary = {batch_id = bid, queue = QUEUE_NAME, total = total, completed = c,
    failed = f, cancelled = x}
  local payload = cjson.encode({{summary}, {}})
  local seq = redis.call('INCR', base .. 'seq')
  redis.call('HSET', key, 'payload', payload, 'codec', 'json', 'opts', '{}',
    'state', 'waiting', 'priority', '0', 'max_stalls', int(DEFAULT_MAX_STALLS),
    'seq', int(seq), 'created_ms', int(now), 'ready_ms', int(now))
  redis.call('ZADD', base .. 'waiting', waiting_score(0, seq), id)
  -- the `then` queue is a queue now: listed as enqueue.lua lists one (a nicety: an index
  -- this caller may not write must not undo the member's finish)
  if QUEUE_INDEX then redis.pcall('SADD', QUEUE_INDEX, then_queue) end
  redis.call('XADD', base .. 'events', 'MAXLEN', '~', MAX_EVENTS, '*', 'kind', 'added',
    'job', id, 'batch', bid)
  if redis.call('LPUSH', base .. 'wake', '1') > WAKE_CAP then
    redis.call('LTRIM', base .. 'wake', 0, WAKE_CAP - 1)
  end
  return nil
end

-- The batch is done when it is sealed and every member is final: mark it (its expiry
-- starts), and send its follow-up unless it was sent before (a member retried after the
-- batch was done makes it not done; done again, it sends nothing more). Returns why the
-- follow-up could not be sent, if it could not.
local function batch_check_done(bid, now)
  local bkey = BATCH .. bid
  local f = redis.call('HMGET', bkey, 'sealed', 'total', 'completed', 'failed', 'cancelled',
    'done_ms', 'then', 'then_sent', 'ttl_ms')
  if f[1] ~= '1' or f[6] then return nil end
  local total, c, fl, x = count_or(f[2], -1), count_or(f[3], 0), count_or(f[4], 0),
    count_or(f[5], 0)
  if c + fl + x ~= total then return nil end
  redis.call('HSET', bkey, 'done_ms', int(now))
  redis.call('ZADD', BATCHES, int(now + count_or(f[9], BATCH_TTL_MS)), bid)
  if f[7] and f[7] ~= '' and not f[8] then
    redis.call('HSET', bkey, 'then_sent', int(now))
    return send_follow_up(bid, f[7], total, c, fl, x, now)
  end
  return nil
end

-- When batch `bid` expired (ms) and its ttl (ms), or nil while it is kept: the one test of
-- expiry, for every script that reads or acts on a batch. It is due for retention's sweep
-- (sweep_batches) from its score in BATCHES on (done_ms + ttl_ms), and once a sweep started
-- on it (`swept`) it stays expired, whatever a member's fence has done to that score since.
-- Readers must not see it past that instant: the sweep deletes it TRIM_BUDGET members per
-- finish, and on a quiet queue a half-deleted batch was read as done with every count.
local function batch_expired(bid, now)
  local f = redis.pcall('HMGET', BATCH .. bid, 'done_ms', 'ttl_ms', 'swept')
  if f.err or not f[1] then return nil end -- forged, or not done: not expiring
  local due = tonumber(redis.call('ZSCORE', BATCHES, bid))
  if not (f[3] or (due and due <= now)) then return nil end
  local ttl = count_or(f[2], BATCH_TTL_MS)
  local at = count_or(f[1], 0) + ttl
  if at > now then at = due or now end -- a score set by hand: the sweep's instant, then
  return int(math.min(at, now)), int(ttl)
end

-- Member `id` of batch `bid` went from state `from` to state `to`. Returns why the
-- batch's follow-up could not be sent, when this move made it done and it could not.
-- (pcall: a stream key of another type, forged, costs the batch its stream, never the
-- member's move)
local function member_ended(bid, id, to)
  local index = string.match(id, '%.(%d+)$') or id
  redis.pcall('XADD', BATCH_DONE .. bid, '*', 'i', index, 's', FINAL_CODE[to])
end

local function member_reopened(bid, id)
  local index = string.match(id, '%.(%d+)$') or id
  redis.pcall('XADD', BATCH_DONE .. bid, '*', 'i', index, 's', 'r')
end

local function batch_not_done(bid)
  if redis.call('HDEL', BATCH .. bid, 'done_ms') == 1 then redis.call('ZREM', BATCHES, bid) end
end

local function batch_move(bid, id, from, to, now)
  if not bid or from == to then return nil end
  local bkey = BATCH .. bid
  -- forgotten (no counters to keep), or a key of another type in its place (forged)
  if redis.call('TYPE', bkey).ok ~= 'hash' then return nil end
  if COUNTED[from] then add_count(bkey, from, -1) end
  if COUNTED[to] then add_count(bkey, to, 1) end
  if FINAL_CODE[to] and not FINAL_CODE[from] then
    member_ended(bid, id, to)
    return batch_check_done(bid, now)
  elseif FINAL_CODE[from] and not FINAL_CODE[to] then
    -- a final member runs again: the batch is not done (nor expiring) until it ends again,
    -- and its stream says so ('r', reopened), so a reader waits for its new end
    member_reopened(bid, id)
    batch_not_done(bid)
  end
  return nil
end

-- Members of batch `bid` (which exists) moved in one call, each one's stream entry
-- written (member_ended, member_reopened): `moves` counts them by "<from> <to>". The
-- counters move once; the batch is looked at once for being done, or is not done any more
-- (batch_each.lua).
local function batch_members_moved(bid, moves, now)
  local bkey, ended, reopened = BATCH .. bid, false, false
  for move, count in pairs(moves) do
    local from, to = string.match(move, '^(%S+) (%S+)$')
    if COUNTED[from] then add_count(bkey, from, -count) end
    if COUNTED[to] then add_count(bkey, to, count) end
    ended = ended or (FINAL_CODE[to] and not FINAL_CODE[from])
    reopened = reopened or (FINAL_CODE[from] and not FINAL_CODE[to])
  end
  if reopened then batch_not_done(bid) end
  if ended then return batch_check_done(bid, now) end
  return nil
end

-- After a script moved job `id` out of state `from`: its batch (if any) follows.
-- Returns why its batch's follow-up could not be sent, if this move made it done and it
-- could not (finish.lua tells the worker, which logs it).
local function batch_after(id, from, now)
  local f = hmget(PREFIX .. id, 'batch', 'state')
  if f and f[1] then return batch_move(f[1], id, from, f[2], now) end
  return nil
end

-- Retention (trim_finished) takes a member out of its finished set's index, never its
-- record: the batch keeps it until the batch goes (sweep_batch). Returns 1 if the job
-- went, 0 for a member kept: retention counts only what it removed (JobNotFound and the
-- trimmed metric said 95 jobs removed by the cap when every one of them was kept).
local function drop_unless_member(id)
  -- Only an id shaped like a member's (models.member_id: "<batch id>.<index>") is looked
  -- up: trimming runs on every finish past the limit, and most jobs are not members.
  if string.match(id, '^[%w_%-]+%.%d+$') and redis.pcall('HEXISTS', PREFIX .. id, 'batch') == 1 then
    return 0
  end
  drop_job(id)
  return 1
end

-- Job `id` was cancelled while running and its fence still stands (rules.fence_lifted):
-- the last millisecond of its fence (the old lease's expiry), else nil. Until then its
-- child may still live, so its record must stay (design invariant 12).
local function fenced_until(id, now)
  local f = hmget(PREFIX .. id, 'fence_token', 'fenced_until_ms')
  local until_ms = f and tonumber(f[2])
  if f ~= nil and f[1] and until_ms and not (until_ms < now) then return until_ms end
  return nil
end

-- Delete up to `budget` members of batch `bid` (from where the last call stopped), then
-- the batch itself. Returns 1 when the batch is gone, 0 when there is more to delete, or
-- -3 and the fence's end when it reached a member whose fence still stands: it stops
-- there (a forget waits, a retention sweep comes back after it), so the id cannot be
-- enqueued afresh and run beside a child that may still live.
local function sweep_batch(bid, budget, now)
  local bkey = BATCH .. bid
  local f = redis.pcall('HMGET', bkey, 'total', 'enqueued', 'swept')
  if f.err then f = {} end -- a key of another type in its place (forged): it goes below
  local last = math.max(count_or(f[1], 0), count_or(f[2], 0))
  local from = count_or(f[3], 0)
  local upto = math.min(last, from + budget)
  for i = from, upto - 1 do
    local id = bid .. '.' .. i
    if redis.pcall('HGET', PREFIX .. id, 'batch') == bid then -- never another job of that id
      local until_ms = fenced_until(id, now)
      if until_ms then
        redis.call('HSET', bkey, 'swept', int(i))
        return -3, until_ms
      end
      drop_job(id)
      redis.call('ZREM', COMPLETED, id)
      redis.call('ZREM', FAILED, id)
      redis.call('ZREM', CANCELLED, id)
      redis.call('ZREM', EXPIRY, id)
    end
  end
  if upto >= last then
    redis.call('DEL', bkey, BATCH_DONE .. bid)
    redis.call('ZREM', BATCHES, bid)
    redis.call('ZREM', BATCH_INDEX, bid)
    return 1
  end
  redis.call('HSET', bkey, 'swept', int(upto))
  return 0
end

-- Batches past their batch_ttl_s go, TRIM_BUDGET members per round, like finished jobs:
-- up to `rounds` rounds (one per job that finished), ending at the first with none due.
-- One held by a member's fence is due again a second later, or when the fence ends if
-- sooner (its worker may confirm the child dead before then: it lifts the fence).
local function sweep_batches(now, rounds)
  for _ = 1, rounds or 1 do
    local due = redis.call('ZRANGEBYSCORE', BATCHES, '-inf', int(now), 'LIMIT', 0, 1)
    if #due == 0 then return end
    local gone, until_ms = sweep_batch(due[1], TRIM_BUDGET, now)
    if gone == -3 then
      redis.call('ZADD', BATCHES, int(math.min(until_ms + 1, now + 1000)), due[1])
    end
  end
end
-- ---- end of batches ---------------------------------------------------------------------

-- ---- retention (README "Retention"; rules.Retention) -------------------------------------
-- A finished job is kept for its own time to live (a job option) or else the queue's (the
-- caller's ARGV[4]). Most jobs are kept for the queue's time, and their finished set, in
-- order of when they finished, already says which are past it: such a "plain" job has no
-- entry of its own in EXPIRY (134 bytes a job: retention_bench), and age_out reads the set
-- from where it last stopped. Every other finished job has an EXPIRY entry: one with a time
-- to live of its own, one whose finisher's queue time was not the one in force (workers of
-- one queue set differently), and one still fenced when its time came.
--   sq:{q}:expiry  ZSET  those jobs, by when they go
--   sq:{q}:trims   HASH  what retention removed: <state>_capped (jobs trimmed by the count
--                        cap), <state>_capped_newest_ms (when the newest of them finished),
--                        <state>_cap (the cap then), expired (jobs removed by age),
--                        expired_upto_ms (the latest such removal); JobNotFound reads it.
--                        Per finished set: <state>_ttl "<ms> <newest>": the queue time every
--                        plain job of the set is kept for, and 0, or once a finisher set
--                        differently came, a time no plain job finished after (plain_ttl_ms);
--                        <state>_aged "<score> <kept> <next ms> <id>": where age_out's last
--                        read stopped, how many jobs it kept at that score, when the next
--                        job is due (0: read on), the last of the jobs kept
--   (EXPIRY, TRIMS, STATE_OF, finished key -> state, and RETENTION are set per call: bind)

-- A job's own time to live on entering finished `state`, ms (rules.Retention.ttl_ms), or
-- nil when it has none and the queue's applies. Its options are decoded only when they
-- name one: most jobs' are '{}'.
local function own_ttl_ms(opts, state)
  local name = state == 'completed' and 'result_ttl_s' or 'failure_ttl_s'
  if opts and string.find(opts, name, 1, true) then
    local ok, o = pcall(cjson.decode, opts)
    local v = ok and type(o) == 'table' and o[name]
    if type(v) == 'number' and v >= 0 then return math.max(0, math.ceil(v * 1000)) end
  end
  return nil
end

-- The caller's queue time to live for finished `state`, ms.
local function queue_ttl_ms(state)
  if state == 'completed' then return COMPLETED_TTL_MS end
  return FAILED_TTL_MS
end

-- The retention records of finished set `zset` (TRIMS), read once per call: the time in
-- force (nil: no plain job yet) and `newest`, then where age_out stopped ('-inf', 0: at
-- the start) and when it next has a job to remove. A record changed by hand reads as
-- absent.
local function retention_of(zset)
  local r = RETENTION[zset]
  if not r then
    local state = STATE_OF[zset]
    local rec = redis.call('HMGET', TRIMS, state .. '_ttl', state .. '_aged')
    local ttl, newest = string.match(rec[1] or '', '^(%d+) (%d+)$')
    local score, kept, next_ms, last = string.match(rec[2] or '', '^(%S+) (%d+) (%d+) (.*)$')
    if score ~= '-inf' and not string.match(score or '', '^%d+$') then score = nil end
    r = {state = state, ttl = tonumber(ttl), newest = tonumber(newest) or 0,
      score = score or '-inf', kept = tonumber(kept) or 0, next_ms = tonumber(next_ms) or 0,
      last = last}
    RETENTION[zset] = r
  end
  return r
end

-- The time to live a job entering finished set `zset` now is plain at: the caller's queue
-- time when it is in force (or none is yet), else false (the job gets an EXPIRY entry).
-- While every finisher has the same time nothing is written after the first. Once one set
-- differently comes, `newest` is kept (each call by a finisher of the time in force sets
-- it to now), and when age_out's read has passed it (or read every job at it, all kept),
-- every plain job kept for the old time has been read: the next finisher's time comes in
-- force.
local function plain_ttl_ms(zset, now)
  local r = retention_of(zset)
  if r.plain == nil then
    local mine, write = queue_ttl_ms(r.state), false
    if not r.ttl then
      r.plain, r.ttl, write = mine, mine, true
    elseif r.ttl == mine then
      r.plain = mine
      if r.newest > 0 then r.newest, write = now, true end
    elseif r.newest > 0 and r.score ~= '-inf' and (tonumber(r.score) > r.newest
        or (tonumber(r.score) == r.newest
          and #redis.call('ZRANGEBYSCORE', zset, r.score, r.score, 'LIMIT', r.kept, 1) == 0)) then
      r.plain, r.ttl, r.newest, r.next_ms, write = mine, mine, 0, 0, true
    else
      r.plain = false
      if r.newest == 0 then r.newest, write = now, true end
    end
    if write then redis.call('HSET', TRIMS, r.state .. '_ttl', int(r.ttl) .. ' ' .. int(r.newest)) end
  end
  return r.plain
end

-- Job `id` was cancelled while running and its fence still stands (rules.fence_lifted).
local function fenced(id, now)
  return fenced_until(id, now) ~= nil
end

-- A job past its time goes, hash and history (a batch member's stay with its batch), from
-- every index. `state`: the state its hash holds; an index entry is only trusted while the
-- job is still finished (never an id enqueued again since: purge and retry take their
-- entries out, this is the second guard). Returns 1 if the job went, else 0 (a member
-- its batch keeps).
local function expire_job(id, state)
  redis.call('ZREM', EXPIRY, id)
  redis.call('ZREM', COMPLETED, id)
  redis.call('ZREM', FAILED, id)
  redis.call('ZREM', CANCELLED, id)
  if state == 'completed' or state == 'failed' or state == 'cancelled' then
    return drop_unless_member(id)
  end
  return 0
end

local function count_expired(expired, now)
  if expired > 0 then
    redis.call('HINCRBY', TRIMS, 'expired', expired)
    redis.call('HSET', TRIMS, 'expired_upto_ms', int(now))
  end
end

-- Retention by age, part one: the jobs of EXPIRY that are due go, `budget` at most, the
-- earliest first (ties by id). A job cancelled while running keeps its fence until its old
-- owner confirms the child dead or the old lease runs out (design invariant 12, as
-- purge.lua): one still fenced is kept until the old lease's expiry, so its id cannot be
-- enqueued afresh and run beside a child that may still live. Returns the budget left.
local function expire_due(now, budget)
  if budget <= 0 then return budget end
  local ids = redis.call('ZRANGEBYSCORE', EXPIRY, '-inf', int(now), 'LIMIT', 0, budget)
  if #ids == 0 then return budget end
  local expired = 0
  for _, gone in ipairs(ids) do
    local f = hmget(PREFIX .. gone, 'state', 'fence_token', 'fenced_until_ms')
    local until_ms = f and tonumber(f[3])
    if f and f[2] and until_ms and not (until_ms < now) then -- rules.fence_lifted
      redis.call('ZADD', EXPIRY, int(until_ms + 1), gone)
    else
      expired = expired + expire_job(gone, f and f[1])
    end
  end
  count_expired(expired, now)
  return budget - #ids
end

-- Retention by age, part two: the plain jobs of finished set `zset` past the time in force
-- go, `budget` jobs read at most, in the set's order (finished ms, ties by id) from where
-- the last read stopped, up to now minus that time. A job it reads and keeps is one with an
-- EXPIRY entry (it goes at that entry's time, earlier or later) or one still fenced (given
-- an entry for when its fence falls). The jobs kept at the last score read are counted, so
-- the next read starts past them; it reads that score again from its first job when the
-- last of them is no longer where it was (gone, or a job added before it), and the whole
-- set when the clock stands before that score (a failover to a server whose clock is
-- behind): no job is passed over unread. Returns the budget left.
local function age_out(zset, now, budget)
  if budget <= 0 then return budget end
  local r = retention_of(zset)
  local ttl, score, kept, last = r.ttl, r.score, r.kept, r.last
  if not ttl then return budget end -- no plain job has entered this set
  if score ~= '-inf' and tonumber(score) > now then score, kept, r.next_ms = '-inf', 0, 0 end
  -- no job can be due before the next one read last time (a job finishing since is due
  -- later still); a time further than the time to live was not written here
  if now < r.next_ms and r.next_ms <= now + ttl then return budget end
  if kept > 0 and redis.call('ZRANGEBYSCORE', zset, score, score, 'LIMIT', kept - 1, 1)[1] ~= last then
    kept = 0
  end
  local cutoff = int(now - ttl)
  local due = redis.call('ZRANGEBYSCORE', zset, score, cutoff, 'WITHSCORES', 'LIMIT', kept, budget)
  local expired, kept_any = 0, r.kept > 0
  for i = 1, #due, 2 do
    local id, at = due[i], due[i + 1]
    if at ~= score then score, kept = at, 0 end
    local f = hmget(PREFIX .. id, 'state', 'fence_token', 'fenced_until_ms')
    local until_ms = f and tonumber(f[3])
    if redis.call('ZSCORE', EXPIRY, id) then
      kept, last, kept_any = kept + 1, id, true
    elseif f and f[2] and until_ms and not (until_ms < now) then -- rules.fence_lifted
      redis.call('ZADD', EXPIRY, int(until_ms + 1), id)
      kept, last, kept_any = kept + 1, id, true
    else
      -- in no other index: this set's entry goes, and the job while it is in this set's
      -- state (the guard of expire_job)
      redis.call('ZREM', zset, id)
      if f and f[1] == r.state then
        expired = expired + drop_unless_member(id)
      end
    end
  end
  -- nothing was due: the next job is the first after the cutoff (none: one finishing from
  -- now on, due a time to live from now); until then no call reads. When jobs were due,
  -- more are likely soon: the next call reads again.
  local next_ms = 0
  if #due == 0 then
    local after = redis.call('ZRANGEBYSCORE', zset, '(' .. cutoff, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    next_ms = (tonumber(after[2]) or now) + ttl
  end
  -- The position is written only when it matters: jobs kept (the next read must start past
  -- them, and a stale count must not linger) or a time to wait for. With only plain jobs
  -- read, those before the old position are gone, so reading from it finds the same jobs.
  if kept_any or next_ms > 0 then
    r.score, r.kept, r.next_ms, r.last = score, kept, next_ms, last
    redis.call('HSET', TRIMS, r.state .. '_aged',
      score .. ' ' .. kept .. ' ' .. int(next_ms) .. ' ' .. (kept > 0 and last or ''))
  end
  count_expired(expired, now)
  return budget - #due / 2
end

-- Retention, part one: job `id` entered finished set `zset` (its options `opts`). It gets
-- an EXPIRY entry unless it is plain (kept for the queue's time in force: plain_ttl_ms).
local function keep_until(zset, now, id, opts)
  local state = STATE_OF[zset]
  local ttl = own_ttl_ms(opts, state)
  if not ttl then
    ttl = queue_ttl_ms(state)
    if plain_ttl_ms(zset, now) == ttl then return end
  end
  redis.call('ZADD', EXPIRY, int(now + ttl), id)
end

-- Retention, part two, after `jobs` jobs entered finished set `zset`: the set keeps at most
-- `keep` jobs (the oldest go first, ties by id: the sorted set's order; counted in TRIMS;
-- one still fenced stays), then jobs past their time go (expire_due, then age_out of this
-- set: the others are read by recover_stalled.lua), then done batches
-- past theirs. Bounded work per call (TRIM_BUDGET per job that entered); every job
-- entering a finished set is followed by this, so the sets converge. finish.lua runs it
-- once for all the jobs of a call (its reads cost as much for one job as for a hundred).
local function retain(zset, keep, now, jobs)
  local budget = TRIM_BUDGET * jobs
  local excess = redis.call('ZCARD', zset) - keep
  if excess > 0 then
    local n = math.min(excess, budget)
    local ids = redis.call('ZRANGE', zset, 0, n - 1, 'WITHSCORES')
    local capped, newest = 0, nil
    for i = 1, #ids, 2 do
      -- a job still fenced stays (as in expire_due: design invariant 12), over the cap
      -- for as long as its fence stands
      if not fenced(ids[i], now) then
        if drop_unless_member(ids[i]) == 1 then capped, newest = capped + 1, ids[i + 1] end
        redis.call('ZREM', EXPIRY, ids[i])
        redis.call('ZREM', zset, ids[i])
      end
    end
    if capped > 0 then
      local state = STATE_OF[zset]
      redis.call('HINCRBY', TRIMS, state .. '_capped', capped)
      redis.call('HSET', TRIMS, state .. '_capped_newest_ms', newest, state .. '_cap', int(keep))
    end
    budget = budget - n
  end
  age_out(zset, now, expire_due(now, budget))
  sweep_batches(now, jobs)
end

-- Both parts for one job.
local function trim_finished(zset, keep, now, id, opts)
  keep_until(zset, now, id, opts)
  retain(zset, keep, now, 1)
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
  local prior = hmget(key, 'batch', 'state', 'opts')
  redis.call('ZREM', WAITING, id)
  redis.call('ZREM', DELAYED, id)
  redis.call('ZREM', ACTIVE, id)
  redis.call('HDEL', key, 'owner', 'token', 'claimed_ms', 'child_pid', 'child_started_ms')
  redis.call('HSET', key, 'state', 'failed', 'outcome', 'error', 'error', err,
    'finished_ms', int(now))
  redis.call('ZADD', FAILED, int(now), id)
  emit('failed', id, 'outcome', 'error', 'error', err)
  trim_finished(FAILED, RETAIN_FAILED, now, id, prior and prior[3])
  if prior and prior[1] then batch_move(prior[1], id, prior[2], 'failed', now) end
end

-- Why a job popped from waiting cannot be claimed (nil when it can), plus its fields.
local function claim_problem(key)
  local f = hmget(key, 'payload', 'codec', 'opts', 'attempts', 'state', 'ready_ms', 'created_ms',
    'batch', 'infra_deaths', 'uncharged')
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
  return nil, f, nil, decoded
end

-- rules.budget_passed: why a popped job must not start (its deadline_s from created_ms
-- passed: 'deadline'; it waited over its max_queue_s since ready_ms: 'expired'), or nil.
local function budget_passed(opts, created_ms, ready_ms, now, attempt)
  local deadline, max_queue = opts.deadline_s, opts.max_queue_s
  if type(deadline) == 'number' then
    local deadline_ms = math.max(0, math.ceil(deadline * 1000))
    if now - created_ms > deadline_ms then
      return 'deadline', string.format(DEADLINE_TEXT, deadline_ms, attempt)
    end
  end
  if type(max_queue) == 'number' then
    local max_ms = math.max(0, math.ceil(max_queue * 1000))
    if now - ready_ms > max_ms then
      return 'expired', string.format(EXPIRED_TEXT, max_ms)
    end
  end
  return nil
end

-- A job a claim popped that must not start (budget_passed): failed with `outcome` as
-- attempt `attempt` of `worker`, which never ran; the claim goes on to the next job.
-- `opts`: its stored options (retention reads its own time to live there).
local function fail_unstarted(id, worker, attempt, outcome, err, bid, now, opts)
  local key = PREFIX .. id
  append_history(id, cjson.encode({attempt = attempt, outcome = outcome, action = 'fail',
    worker_id = worker, ended_ms = now, error = err}))
  redis.call('HSET', key, 'state', 'failed', 'attempts', int(attempt), 'outcome', outcome,
    'error', err, 'finished_ms', int(now))
  redis.call('ZADD', FAILED, int(now), id)
  emit('failed', id, 'outcome', outcome, 'error', err)
  trim_finished(FAILED, RETAIN_FAILED, now, id, opts)
  if bid then batch_move(bid, id, 'waiting', 'failed', now) end
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
    local f = hmget(key, 'priority', 'batch')
    local seq = next_seq()
    -- a broken record still goes to waiting, where claim fails it with a stated cause
    if f and redis.call('EXISTS', key) == 1 then
      redis.call('HSET', key, 'state', 'waiting', 'seq', int(seq))
      -- a fenced retry falls due when the old lease would have run out: the fence is over
      redis.call('HDEL', key, 'fence_owner', 'fence_token', 'fenced_until_ms')
      if f[2] then batch_move(f[2], id, 'delayed', 'waiting', now) end
    end
    redis.call('ZADD', WAITING, waiting_score(f and f[1], seq), id)
  end
end

-- When the attempt a job's owner holds started (when its child took it, as the owner's
-- registry record says; else its claim) and the pid of its child, from the owner's
-- registry record (absent until its heartbeat published it), else as that record last
-- noted it on the job (child_pids.lua): a dead owner's record expires with its lease,
-- before the lease is found lost. For the record of an attempt that ends without
-- its worker (cancelled, lease lost). A record that does not decode is skipped: it is
-- another process's word. No pid, no start (nil, nil): a job claimed ahead (prefetch) waits
-- in its worker, lease running, for a child it may never get, and its claim was no start.
local function running_attempt(key, id, owner)
  local f = redis.call('HMGET', key, 'claimed_ms', 'child_pid', 'child_started_ms')
  local started, pid = count_or(f[3], nil) or tonumber(f[1]), count_or(f[2], nil)
  local wkey = owner and QUEUE_BASE .. 'worker:' .. owner
  if wkey and redis.call('TYPE', wkey)['ok'] == 'string'
      and redis.call('STRLEN', wkey) <= MAX_FIELD_BYTES then
    local raw = redis.call('MGET', wkey)[1] -- what a producer may run on it (acl.py)
    if type(raw) == 'string' then
      local ok, rec = pcall(cjson.decode, raw)
      if ok and type(rec) == 'table' and type(rec.jobs) == 'table' then
        for _, job in ipairs(rec.jobs) do
          if type(job) == 'table' and job.id == id and type(job.pid) == 'number' then
            pid = job.pid
            -- when its child took it: a job claimed ahead waited in its worker before
            if type(job.started_ms) == 'number' then started = job.started_ms end
          end
        end
      end
    end
  end
  if pid == nil then return nil, nil end
  return started, pid
end

-- Cancel one job, at `now`, but for retention and its batch (cancel_job, and batch_each.lua
-- for a batch's members, which does those once for all): see cancel.lua. Returns the
-- state it left and its opts, or nil when it was unknown or already finished.
local function cancel_move(id, channel, now)
  local key = PREFIX .. id
  local f = hmget(key, 'state', 'owner', 'token', 'attempts', 'opts')
  if not f then return nil end
  local state = f[1]
  if state ~= 'waiting' and state ~= 'delayed' and state ~= 'active' then return nil end
  local err = string.format(CANCELLED_TEXT, state)
  local token
  if state == 'active' then
    local expiry = redis.call('ZSCORE', ACTIVE, id)
    if f[3] then
      token = f[3]
      redis.call('HSET', key, 'fence_owner', f[2] or '', 'fence_token', token,
        'fenced_until_ms', int(tonumber(expiry) or now))
    end
    local record = {attempt = count_or(f[4], 0), outcome = 'cancelled', ended_ms = now,
      error = err}
    if f[2] then record.worker_id = f[2] end
    record.started_ms, record.pid = running_attempt(key, id, f[2])
    append_history(id, cjson.encode(record))
  end
  redis.call('ZREM', WAITING, id)
  redis.call('ZREM', DELAYED, id)
  redis.call('ZREM', ACTIVE, id)
  redis.call('HDEL', key, 'owner', 'token', 'claimed_ms', 'child_pid', 'child_started_ms')
  redis.call('HSET', key, 'state', 'cancelled', 'finished_ms', int(now), 'outcome', 'cancelled',
    'error', err)
  redis.call('ZADD', CANCELLED, int(now), id)
  emit('cancelled', id, 'from', state)
  -- Only a lease's owner has an attempt to stop; no worker holds a job without one.
  if token then redis.call('PUBLISH', channel, token .. ' ' .. id) end
  return state, f[5]
end

-- Cancel one job (cancel.lua): see cancel.lua. Returns 1 cancelled, 0 unknown or already
-- finished.
local function cancel_job(id, channel)
  local now = now_ms()
  local from, opts = cancel_move(id, channel, now)
  if not from then return 0 end
  trim_finished(CANCELLED, RETAIN_FAILED, now, id, opts)
  batch_after(id, from, now) -- batches (common.lua)
  return 1
end

-- Whether a cancel of batch `bid` is under way (batch_each.lua marks the batch): if so,
-- the mark counts one more member the claim cancels for it. Set, not HINCRBY: a mark
-- that is not a count (forged) would fail the claim after its ZPOPMIN, and the jobs it
-- popped would be out of line for good; such a mark starts again from this member.
local function counted_by_batch_cancel(bid)
  local mark = redis.pcall('HGET', BATCH .. bid, 'cancelling')
  if type(mark) ~= 'string' then return false end -- none, or not a hash (forged)
  redis.call('HSET', BATCH .. bid, 'cancelling', int(count_or(mark, 0) + 1))
  return true
end

-- Lease up to `count` waiting jobs (design invariant 1: a fresh token per claim, owner = worker;
-- design invariant 2: expiry from the server clock). Returns a flat list of CLAIM_ROW entries
-- per claimed job: id, token, payload, codec, opts, attempt (charged: what the retry budget
-- counts), wait ms, infra deaths, number (the attempt's place in the job's history), age ms
-- (since enqueue: what the worker has left of its deadline_s). A job past its deadline_s or
-- max_queue_s is failed instead (budget_passed), and a member of a batch whose cancel is
-- under way (batch_each.lua) is cancelled instead.
-- 'attempts' counts every attempt started, never reset, so history numbers keep counting
-- across requeues and manual retries; 'uncharged' (absent: 0) counts those the retry budget
-- does not: requeued ones (back_in_line) and those before a manual retry (retry_job).
local function claim_jobs(worker, count, lease_ms, token_base, now)
  promote_due(now)
  local out = {}
  local n = 0
  local expiry = int(now + lease_ms)
  -- popped `count - n` at a time (one call for many jobs); every popped job is claimed or
  -- failed below, never left out of line
  local popped, at = {}, 1
  local cancelled = 0
  while n < count do
    if at > #popped then
      -- cancelled members count toward a bound of their own: one claim never does a
      -- whole cancel's work (claim.lua tells the worker to claim again at once)
      if cancelled >= TRIM_BUDGET then break end
      popped, at = redis.call('ZPOPMIN', WAITING, count - n), 1
      if #popped == 0 then break end
    end
    local id = popped[at]
    at = at + 2
    local key = PREFIX .. id
    local problem, f, bad_field, opts = claim_problem(key)
    local number, created, late, why
    if not problem then
      number, created = count_or(f[4], 0) + 1, tonumber(f[7]) or now
      late, why = budget_passed(opts, created, tonumber(f[6]) or created, now, number)
    end
    if problem then
      fail_malformed(id, problem, now, bad_field)
    elseif late then
      fail_unstarted(id, worker, number, late, why, f[8], now, f[3])
    elseif f[8] and counted_by_batch_cancel(f[8]) then
      -- its batch's cancel is under way (batch_each.lua): it never starts
      cancel_job(id, '')
      cancelled = cancelled + 1
    else
      n = n + 1
      local token = token_base .. '.' .. n
      redis.call('HSET', key, 'state', 'active', 'owner', worker, 'token', token,
        'attempts', int(number), 'claimed_ms', int(now))
      redis.call('ZADD', ACTIVE, expiry, id)
      emit('active', id, 'worker', worker, 'attempt', int(number))
      if f[8] then batch_move(f[8], id, 'waiting', 'active', now) end
      local i = #out
      out[i + 1], out[i + 2], out[i + 3] = id, token, f[1]
      out[i + 4], out[i + 5] = f[2], f[3]
      out[i + 6] = math.max(1, number - (count_or(f[10], 0)))
      -- how long it waited since it was ready (enqueued, due, retried): sandboxq_wait_seconds
      out[i + 7] = int(math.max(0, now - (tonumber(f[6]) or tonumber(f[7]) or now)))
      out[i + 8] = count_or(f[9], 0) -- the worker fails it as poison at its limit
      out[i + 9] = number
      out[i + 10] = int(math.max(0, now - created)) -- its age: what is left of deadline_s
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

-- The caller's lease is the job's current lease (design invariant 1). Returns the job's
-- fields (owner, token, state, then the `...` named: read in the same call), or nil.
local function owns(key, worker, token, ...)
  local f = hmget(key, 'owner', 'token', 'state', ...)
  if f ~= nil and f[1] == worker and f[2] == token and f[3] == 'active' then return f end
  return nil
end

-- The (job id, token) pairs of ARGV from index `first` on, for `for id, token in ...`.
local function lease_pairs(first)
  local i = first - 2
  return function()
    i = i + 2
    if ARGV[i] ~= nil then return ARGV[i], ARGV[i + 1] end
  end
end

-- A claimed job back in line without charging its attempt (requeue, release), at its old
-- place (seq), since it was claimed first. `ran`: the attempt started and has a record, so
-- its number stays used (one more uncharged attempt: the history keeps counting); else
-- (released before it started) the number is given back. Returns the fields to HSET.
local function back_in_line(key, id, ran)
  local f = redis.call('HMGET', key, 'uncharged', 'priority', 'seq', 'attempts')
  redis.call('ZADD', WAITING, waiting_score(f[2], count_or(f[3], nil) or next_seq()), id)
  if ran then return 'state', 'waiting', 'uncharged', int(count_or(f[1], 0) + 1) end
  return 'state', 'waiting', 'attempts', int(math.max(count_or(f[4], 1) - 1, 0))
end

-- Put a failed or cancelled job back in line, at `now`, but for waking a worker and its
-- batch (retry_job, and batch_each.lua for a batch's members, which does those once for
-- all): see retry_failed.lua. Returns the state it left and the one it went to, or nil
-- when it was not failed or cancelled.
local function retry_move(id, now)
  local key = PREFIX .. id
  local f = hmget(key, 'state', 'priority', 'fence_token', 'fenced_until_ms', 'attempts')
  if not f or (f[1] ~= 'failed' and f[1] ~= 'cancelled') then return nil end
  -- the retry budget starts again; the history's numbers go on (claim_jobs)
  local uncharged = int(count_or(f[5], 0))
  redis.call('ZREM', FAILED, id)
  redis.call('ZREM', CANCELLED, id)
  redis.call('ZREM', EXPIRY, id)
  redis.call('HDEL', key, 'finished_ms', 'outcome', 'error', 'result', 'owner', 'token',
    'progress', 'progress_message')
  local until_ms = tonumber(f[4])
  if f[3] and until_ms and not (until_ms < now) then -- fenced (rules.fence_lifted)
    -- due, and so ready, the first millisecond the fence is lifted
    redis.call('HSET', key, 'state', 'delayed', 'uncharged', uncharged, 'stalls', '0',
      'infra_deaths', '0', 'ready_ms', int(until_ms + 1))
    redis.call('ZADD', DELAYED, int(until_ms + 1), id)
    emit('retried', id, 'manual', '1', 'fenced_until_ms', int(until_ms))
    return f[1], 'delayed' -- a woken worker re-reads the next due time
  end
  redis.call('HDEL', key, 'fence_owner', 'fence_token', 'fenced_until_ms')
  local seq = next_seq()
  redis.call('HSET', key, 'state', 'waiting', 'uncharged', uncharged, 'stalls', '0',
    'infra_deaths', '0', 'seq', int(seq), 'ready_ms', int(now))
  redis.call('ZADD', WAITING, waiting_score(f[2], seq), id)
  emit('retried', id, 'manual', '1')
  return f[1], 'waiting'
end

-- Put a failed or cancelled job back in line (retry_failed.lua): see retry_failed.lua.
-- Returns 1 put back, 0 not failed/cancelled.
local function retry_job(id)
  local now = now_ms()
  local from = retry_move(id, now)
  if not from then return 0 end
  wake(1)
  batch_after(id, from, now) -- batches (common.lua)
  return 1
end
