-- child_pids.lua: note on each job a worker runs the pid of the child running it, and
-- when that child took it.
-- KEYS: the standard list (common.lua); uses the job prefix.
-- ARGV: 1-4 standard; 5 worker id, then quadruples: job id, attempt number, child pid,
--       its start in ms or '' (rules.child_pids of the worker's registry record).
-- Returns: how many jobs it noted a pid on.
-- Upholds: the record of an attempt that ends without its worker (lease lost, cancelled:
-- common.lua's running_attempt) names its child even once the worker's registry record is
-- gone, as it is when the worker died: that record expires with the dead worker's leases.
-- A pid is noted only on a job the worker still holds, in the attempt it was read for
-- (the job may have finished, or been claimed again, since the worker read it), and the
-- field goes with the attempt (every HDEL of claimed_ms).

local worker = ARGV[5]
local noted = 0
local i = 6
while ARGV[i + 3] ~= nil do
  local key, number, pid, started = PREFIX .. ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local f = hmget(key, 'owner', 'state', 'attempts')
  if f and f[1] == worker and f[2] == 'active' and f[3] == number and is_count(pid) then
    redis.call('HSET', key, 'child_pid', pid)
    if is_count(started) then redis.call('HSET', key, 'child_started_ms', started) end
    noted = noted + 1
  end
  i = i + 4
end
return noted
