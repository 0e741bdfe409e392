-- KEYS[1] the permit counter of one opening. ARGV[1] limit, ARGV[2] ttl ms.
local taken = tonumber(redis.call('GET', KEYS[1]) or '0')
if taken >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
