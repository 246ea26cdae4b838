-- child_pids.lua: note on each job a worker runs the pid of the child running it.
-- KEYS: the standard list (common.lua); uses the job prefix.
-- ARGV: 1-4 standard; 5 worker id, then triples: job id, attempt number, child pid
--       (rules.child_pids of the worker's registry record).
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
while ARGV[i + 2] ~= nil do
  local key, number, pid = PREFIX .. ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local f = hmget(key, 'owner', 'state', 'attempts')
  if f and f[1] == worker and f[2] == 'active' and f[3] == number and is_count(pid) then
    redis.call('HSET', key, 'child_pid', pid)
    noted = noted + 1
  end
  i = i + 3
end
return noted
