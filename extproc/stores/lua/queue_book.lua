-- An appointment in the pool's book (core/appointments.book): the one the request holds under its
-- name while that is still ahead and it comes back; else the first time at or after now +
-- earliest and the next free times of its class and of the classes served before it; none past
-- now + latest. Its class's next free time moves past it by spacing, and so do those of the
-- classes served after it that were booked later, none past its class's horizon. A slot that
-- would end past its horizon is not taken: it is told the horizon (or its time, if sooner).
--   P:appt        HASH  class -> the book's next free time for it (Redis TIME, ms)
--   P:appt:kept   ZSET  request name -> its appointment (ms); those past are dropped
-- ARGV: class, earliest ms, spacing ms, latest ms (-1: no limit), horizon ms, name ('': none),
-- again ('1': it comes back), n, then the n classes served before it, then for each class served
-- after it: the class, its horizon ms. Returns ms from now, or -1.
local now = now_ms()
local pages, kept = P .. ':appt', P .. ':appt:kept'
local class, earliest, spacing, latest = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local farthest, name, first = now + tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[8])
if name ~= '' and ARGV[7] == '1' then
  local held = tonumber(redis.call('ZSCORE', kept, name) or '0')
  if held > now then return held - now end
end
local at = math.max(now + earliest, tonumber(redis.call('HGET', pages, class) or '0'))
for i = 9, 8 + first do
  at = math.max(at, tonumber(redis.call('HGET', pages, ARGV[i]) or '0'))
end
if latest >= 0 and at > now + latest then return -1 end
if at + spacing > farthest then
  at = math.min(at, farthest) -- its book is full to its horizon: told the horizon, no slot taken
else
  redis.call('HSET', pages, class, at + spacing)
  for i = 9 + first, #ARGV, 2 do
    local later = tonumber(redis.call('HGET', pages, ARGV[i]) or '0')
    if later > at then redis.call('HSET', pages, ARGV[i], math.min(later + spacing, now + tonumber(ARGV[i + 1]))) end
  end
  local last = 0
  for _, v in ipairs(redis.call('HVALS', pages)) do last = math.max(last, tonumber(v)) end
  redis.call('PEXPIRE', pages, math.max(1000, last - now))
end
if name ~= '' then
  redis.call('ZREMRANGEBYSCORE', kept, '-inf', now)
  redis.call('ZADD', kept, at, name)
  local newest = redis.call('ZRANGE', kept, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', kept, math.max(1000, tonumber(newest[2]) - now))
end
return at - now
