-- page.lua: one page of a state's jobs with their summaries (read-only).
-- KEYS: the standard list (common.lua); reads one state ZSET and the job hashes it names.
-- ARGV: 1-4 standard (unused); 5 state, 6 'asc' or 'desc', 7 score to start from
--       ('-inf' / '+inf' for the first page), 8 jobs at exactly that score already shown,
--       9 page size, 10 outcome to keep ('' = every job), 11 most jobs to look at,
--       12 bytes of error to return (base.ERROR_CLIP; rules.clip_error does the same).
-- Returns: {more (1/0: a job follows the last one looked at), last score, jobs at that
--          score shown, scanned, then 7 entries per job: id, state, attempts, outcome,
--          error (its first ARGV[12] bytes), created_ms, finished_ms}.
-- Upholds: bounded work whatever the queue's size: a ZSET range from a score (O(log N +
-- scanned)), never a scan of every job; the cursor is (score, ties shown), so jobs that
-- leave the set between pages do not shift the next page. Ties in score are in member
-- (id) order, as the memory backend orders them. Writes nothing.

local sets = {waiting = WAITING, delayed = DELAYED, active = ACTIVE, completed = COMPLETED,
  failed = FAILED, cancelled = CANCELLED}
local zset = sets[ARGV[5]]
if not zset then return redis.error_reply('unknown state ' .. short(ARGV[5])) end
local desc = ARGV[6] == 'desc'
local score, ties = ARGV[7], tonumber(ARGV[8])
local limit, want = tonumber(ARGV[9]), ARGV[10]
local budget, clip = tonumber(ARGV[11]), tonumber(ARGV[12])

local rows, found, scanned, more = {}, 0, 0, 1
while found < limit and scanned < budget do
  local n = limit - found
  if want ~= '' then n = math.min(200, budget - scanned) end
  local batch
  if desc then
    batch = redis.call('ZREVRANGEBYSCORE', zset, score, '-inf', 'WITHSCORES', 'LIMIT', ties, n)
  else
    batch = redis.call('ZRANGEBYSCORE', zset, score, '+inf', 'WITHSCORES', 'LIMIT', ties, n)
  end
  local stop = false
  for i = 1, #batch, 2 do
    local id, s = batch[i], batch[i + 1]
    scanned = scanned + 1
    if s == score then ties = ties + 1 else score, ties = s, 1 end
    local f = hmget(PREFIX .. id, 'state', 'attempts', 'outcome', 'error', 'created_ms',
      'finished_ms', 'uncharged')
    if f and f[1] and (want == '' or f[3] == want) then
      local err = f[4]
      if err then err = string.sub(err, 1, clip) end
      -- charged attempts, as job_info counts them (claim_jobs: 'attempts' counts every start)
      local charged = f[2] or ''
      if f[7] and is_count(f[2]) then
        charged = tostring(math.max(0, tonumber(f[2]) - (count_or(f[7], 0))))
      end
      local j = #rows
      rows[j + 1], rows[j + 2], rows[j + 3], rows[j + 4] = id, f[1], charged, f[3] or ''
      rows[j + 5], rows[j + 6], rows[j + 7] = err or '', f[5] or '', f[6] or ''
      found = found + 1
      if found >= limit then
        stop = true
        break
      end
    end
  end
  if not stop and #batch < 2 * n then
    more = 0
    break
  end
  if stop then break end
end
if more == 1 then -- stopped by the page size or the scan budget: is there anything after?
  local next_one
  if desc then
    next_one = redis.call('ZREVRANGEBYSCORE', zset, score, '-inf', 'LIMIT', ties, 1)
  else
    next_one = redis.call('ZRANGEBYSCORE', zset, score, '+inf', 'LIMIT', ties, 1)
  end
  if #next_one == 0 then more = 0 end
end
local out = {more, score, ties, scanned}
for i = 1, #rows do out[#out + 1] = rows[i] end
return out
