-- index_sizes.lua: how many queues each hash slot's index set holds, on one Cluster node
-- (read-only; sent alone to that node, without common.lua: it reads many slots' keys).
-- KEYS: none. A script without a shebang may read keys of every slot its node serves,
--       so the slots' sets are named from ARGV, not declared (keys.py: cluster_index).
-- ARGV: 1 the index's key prefix ("sq:queues:"); then the tag of each slot to read.
-- Returns: pairs (position of the tag among the tags, 1-based; size) for the sets that
--          are not empty, then one position negated per set it could not read here (its
--          slot is moving to another node): the caller reads those by key. A key of the
--          wrong type (changed by hand) counts as empty: it costs its slot's queues only.
-- Upholds: one SCARD per slot, nothing else: 5,500 slots of a 3-node Cluster in one call
-- of a few ms, where one SCARD per slot through a client cost 0.6 s of its CPU.

local prefix = ARGV[1]
local out, moved = {}, {}
for i = 2, #ARGV do
  local size = redis.pcall('SCARD', prefix .. '{' .. ARGV[i] .. '}')
  if type(size) == 'number' then
    if size > 0 then out[#out + 1] = i - 1; out[#out + 1] = size end
  elseif not string.find(tostring(size.err), 'WRONGTYPE', 1, true) then
    moved[#moved + 1] = 1 - i -- a set of the wrong type (forged) holds no queue: skipped
  end
end
for _, position in ipairs(moved) do out[#out + 1] = position end
return out
