-- New limits for the pool. ARGV: max in flight, token budget (-1 none), long share, promote
-- after ms (-1 never), lease ms, latency cap (-1 none), spread, long alone (1: a long ticket
-- waits while a bounded or another long one runs), engines, long quiet ms (...and, one not bounded,
-- until bounded tickets arrive no oftener than one per this long: PoolLine.long_quiet_s).
-- Returns the admitted ids.
-- A quiet spell counts once the line has watched it (PoolLine._watch_from): the moment it starts
-- keeping bounded arrivals is one, unless one came within the spell already.
local was = redis.call('HMGET', P .. ':st', 'alone', 'quiet')
local quiet = tonumber(ARGV[10])
if ARGV[8] == '1' and quiet > 0 and not (was[1] == '1' and tonumber(was[2] or '0') > 0) then
  local now, last = now_ms(), tonumber(redis.call('LINDEX', P .. ':bat', 0) or '-1')
  if last < 0 or not (now >= last and now - last < quiet) then
    redis.call('LPUSH', P .. ':bat', now)
    redis.call('LTRIM', P .. ':bat', 0, QUIET_ARRIVALS - 1)
  end
end
redis.call('HSET', P .. ':st', 'max', ARGV[1], 'budget', ARGV[2], 'share', ARGV[3], 'promote', ARGV[4], 'lcap', ARGV[6],
           'spread', ARGV[7], 'alone', ARGV[8], 'engines', ARGV[9], 'quiet', ARGV[10])
return dispatch(now_ms(), tonumber(ARGV[5]))
