-- fail_malformed.lua: fail a claimed job whose record the worker side could not use
-- (options that are JSON but do not validate), keeping the cause.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 worker id, 6 job id, 7 token, 8 reason, 9 attempt record JSON.
-- Returns: 1 failed, 0 the caller no longer owns the job (nothing changed).
-- Upholds: design invariant 7 (one bad record fails one job with a stated cause; `get` still
-- reads it because the bad options move aside) and design invariant 1 (owner + token checked).

local id = ARGV[6]
if not owns(PREFIX .. id, ARGV[5], ARGV[7]) then return 0 end
append_history(id, ARGV[9])
fail_malformed(id, ARGV[8], now_ms(), 'opts')
return 1
