-- The prelude of every script of the Redis stores (extproc/stores/scripts.py puts it first,
-- after the lease flag constants it writes from extproc.stores.queue.LeaseFlags: FLAG_LONG,
-- FLAG_UNBOUNDED; and QUIET_ARRIVALS, from extproc.core.admission). Time comes from Redis TIME
-- only: a replica's clock never decides an expiry.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
