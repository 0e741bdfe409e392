-- Slots given back. ARGV: owner, lease ms, then the ids of the leases to release (one or
-- many, of this owner: only the owner releases, and nothing after its lease expired).
-- Returns {1 or 0 per id: released, admitted ids}.
local owner, released = ARGV[1], {}
for i = 3, #ARGV do
  local info = redis.call('HGET', P .. ':li', ARGV[i])
  if info and lease_info(info) == owner then
    free_slot(ARGV[i], info)
    released[i - 2] = 1
  else
    released[i - 2] = 0
  end
end
return {released, dispatch(now_ms(), tonumber(ARGV[2]))}
