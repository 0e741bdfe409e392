-- KEYS[1] a hash with a version field. ARGV[1] expected version, then field, value pairs.
local current = redis.call('HGET', KEYS[1], 'version') or '0'
if current ~= ARGV[1] then return {0, redis.call('HGETALL', KEYS[1])} end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return {1, redis.call('HGETALL', KEYS[1])}
