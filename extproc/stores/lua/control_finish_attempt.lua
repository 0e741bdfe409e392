-- KEYS[1] the attempt hash. ARGV[1] the pool it failed in ('' if it did not fail), ARGV[2] window ms.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'running_until', 0, 'failed_in', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
