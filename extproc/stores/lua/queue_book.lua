-- An appointment in the pool's book (core/appointments.book): the first time at or after now +
-- earliest and the next free times of its class and of the classes served before it; none
-- past now + latest. Its class's next free time moves past it by spacing, and so do those of
-- the classes served after it that were booked later.
-- ARGV: class, earliest ms, spacing ms, latest ms (-1: no limit), n, then the n classes served
-- before it, then the classes served after it. Returns ms from now, or -1.
local now = now_ms()
local class, earliest, spacing, latest = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local first = tonumber(ARGV[5])
local at = math.max(now + earliest, tonumber(redis.call('HGET', P .. ':appt', class) or '0'))
for i = 6, 5 + first do
  at = math.max(at, tonumber(redis.call('HGET', P .. ':appt', ARGV[i]) or '0'))
end
if latest >= 0 and at > now + latest then return -1 end
redis.call('HSET', P .. ':appt', class, at + spacing)
for i = 6 + first, #ARGV do
  local later = tonumber(redis.call('HGET', P .. ':appt', ARGV[i]) or '0')
  if later > at then redis.call('HSET', P .. ':appt', ARGV[i], later + spacing) end
end
local horizon = 0
for _, v in ipairs(redis.call('HVALS', P .. ':appt')) do horizon = math.max(horizon, tonumber(v)) end
redis.call('PEXPIRE', P .. ':appt', math.max(1000, horizon - now))
return at - now
