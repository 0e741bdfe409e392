-- KEYS: attempt hashes of running attempts. ARGV[1] lease ms.
local now = now_ms()
for _, key in ipairs(KEYS) do
  if tonumber(redis.call('HGET', key, 'running_until') or '0') > 0 then
    redis.call('HSET', key, 'running_until', now + tonumber(ARGV[1]))
  end
end
return 1
