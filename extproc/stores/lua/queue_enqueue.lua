-- A ticket joins the line, and what fits is admitted.
-- ARGV: id, owner, score, class, branch, cost, long (0/1), ticket ttl ms, lease ms, bounded (0/1),
-- ms since its first attempt (0: a new request; more: it comes back, and keeps its place).
-- Returns {admitted ids, pool_state()}.
local id, owner, score, class, branch = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local cost, long, ttl, lease = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local now = now_ms()
-- The same call again (a batch sent twice, a connection lost after the write): it changes no
-- count. An admitted ticket is answered as admitted; a waiting one keeps its place.
if redis.call('HEXISTS', P .. ':li', id) == 1 then return {{id}, pool_state()} end
if redis.call('EXISTS', P .. ':tk:' .. id) == 1 then return {dispatch(now, lease, id), pool_state()} end
local waited = tonumber(ARGV[11])
local key = class .. '|' .. branch
local serving = tonumber(redis.call('HGET', P .. ':rn', class) or '0')
local round = serving
if waited <= 0 then
  forget_quiet_branches(now - ttl)
  round = math.max(tonumber(redis.call('HGET', P .. ':rr', key) or '0'), serving)
  redis.call('HSET', P .. ':rr', key, round + 1)
  redis.call('ZADD', P .. ':ra', now, key)
end
local seq = redis.call('INCR', P .. ':seq') -- every arrival is counted
reap(now, lease)
local st = read_state()
local bounded = tonumber(ARGV[10])
-- a long ticket of a pool Envoy places waits for a quiet spell (PoolLine.long_quiet_s): only there
-- are the bounded arrivals kept
if bounded == 1 and st.alone == 1 and st.quiet > 0 then
  redis.call('LPUSH', P .. ':bat', now)
  redis.call('LTRIM', P .. ':bat', 0, QUIET_ARRIVALS - 1)
  table.insert(st.bat, 1, tostring(now))
end
-- Nobody in line (the common case): a ticket that fits now is admitted without joining the
-- line and leaving it in the same call. What it leaves behind is what admitting it from the
-- line would leave.
if redis.call('ZCARD', P .. ':wait') == 0 and admits(cost, long, bounded, st, now) == 'yes' then
  take_slot(st, id, owner, cost, long, bounded, class, round, now + lease, serving)
  write_counts(st)
  return {{id}, state_of(st)}
end
local m = string.format('%012d:%013d:%012d:%s:%s', round, now - waited, seq, class, id)
redis.call('HSET', P .. ':tk:' .. id, 'm', m, 'o', owner, 'c', cost, 'l', long, 'k', class, 'b', ARGV[10], 'r', branch)
redis.call('PEXPIRE', P .. ':tk:' .. id, ttl)
redis.call('ZADD', P .. ':wait', score, m)
redis.call('ZADD', P .. ':arrive', now, m)
redis.call('HINCRBY', P .. ':dc', class, 1)
return {admit_from_line(now, lease, id, st), pool_state()}
