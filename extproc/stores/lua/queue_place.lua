-- Where an admitted ticket runs. ARGV: owner, ticket id, backend ("IP:PORT"). Only the lease's
-- owner places it, and only while the lease holds (a ticket released or reaped is not placed
-- again); placed twice, it moves. Returns 1 when placed.
local info = redis.call('HGET', P .. ':li', ARGV[2])
if not info then return 0 end
local owner, cost = lease_info(info)
if owner ~= ARGV[1] then return 0 end
unplace(ARGV[2], cost)
redis.call('HSET', P .. ':pl', ARGV[2], ARGV[3])
redis.call('HINCRBY', P .. ':pt', ARGV[3], cost)
return 1
