-- A replica renews the leases it holds, and says it is alive. ARGV: owner, lease ms, then per
-- lease: id, cost, flags. Returns {lost ids, restored ids, admitted ids, live replicas}.
local now = now_ms()
local owner, lease = ARGV[1], tonumber(ARGV[2])
reap(now, lease)
-- Every replica renews every third of a lease: one that has not for a whole lease is gone.
redis.call('ZADD', P .. ':replicas', now, owner)
redis.call('ZREMRANGEBYSCORE', P .. ':replicas', '-inf', now - lease)
redis.call('PEXPIRE', P .. ':replicas', lease)
local lost, restored = {}, {}
for i = 3, #ARGV, 3 do
  local id, cost, flags = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local holder = lease_owner(id)
  if holder == owner then
    redis.call('ZADD', P .. ':lease', 'XX', now + lease, id)
  elseif holder then
    table.insert(lost, id)
  elseif redis.call('ZSCORE', P .. ':reaped', id) then
    table.insert(lost, id) -- expired and reaped: its slot went to someone else
  else
    -- Redis lost it (restarted empty, or failed over before the write replicated) while the
    -- request still runs: count it again, so over-admission ends with this renewal.
    hold_slot(id, owner, cost, flags, now + lease)
    count_slot(cost, flags, 1)
    leave_line(id) -- admitted elsewhere while Redis did not answer, it may still wait here: no
    -- dispatch admits it again (an enqueue of a ticket that holds a slot adds none either)
    table.insert(restored, id)
  end
end
return {lost, restored, dispatch(now, lease), redis.call('ZCARD', P .. ':replicas')}
