-- read_outcome.lua: where jobs stand, for a batch's failures grouped by outcome and kind
-- and for a stopped run: one light read a job, bounded, many jobs a call.
-- KEYS: the standard list (common.lua); uses the job prefix.
-- ARGV: 1-4 standard; 5... job ids (OUTCOMES_PER_CALL at most: a call holds the server).
-- Returns: per job, {state, outcome, attempts, kind}: the first three as stored (false where
--          absent); kind, for an outcome of error, the type its error names
--          (rules.error_kind), else false; false when the job key is not a hash (none, or
--          another type written by hand).
-- Upholds: design invariant 13 (readers trust nothing in Redis): an error made huge by hand
-- is measured (HSTRLEN), never read past ERROR_KIND_READ_CAP bytes nor sent; what is sent
-- of it is a name of at most ERROR_KIND_HEAD ASCII bytes.

local function standing(key)
  if redis.call('TYPE', key)['ok'] ~= 'hash' then
    return false
  end
  local f = redis.call('HMGET', key, 'state', 'outcome', 'attempts')
  local kind = false
  if f[2] == 'error' then
    kind = OTHER_KIND
    -- rules.error_kind: a dotted name of ASCII identifiers and a colon, in the first bytes
    if redis.call('HSTRLEN', key, 'error') <= ERROR_KIND_READ_CAP then
      local err = redis.call('HGET', key, 'error')
      local name = err and string.match(string.sub(err, 1, ERROR_KIND_HEAD), '^([%w_%.]+):')
      if name and (string.gsub('.' .. name, '%.[%a_][%w_]*', '')) == '' then
        if string.sub(name, 1, 9) == 'builtins.' then name = string.sub(name, 10) end
        kind = name
      end
    end
  end
  return {f[1], f[2], f[3], kind}
end

local rows = {}
for i = 5, #ARGV do
  rows[#rows + 1] = standing(PREFIX .. ARGV[i])
end
return rows
