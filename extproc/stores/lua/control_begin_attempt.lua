-- A named request's attempt begins (core/retries.AttemptLedger.begin). KEYS[1] the attempt hash
-- of one key. ARGV: max attempts, lease ms, window ms, the request's digest ('' unknown), fresh
-- ('1': its client calls it a first attempt, and the name starts over).
-- Returns {verdict, attempts, pool its last attempt failed in, ms since the first}.
local now = now_ms()
local e = redis.call('HMGET', KEYS[1], 'attempts', 'running_until', 'failed_in', 'first', 'digest')
local digest = ARGV[4] or ''
if not e[1] or ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'attempts', 1, 'running_until', now + tonumber(ARGV[2]), 'failed_in', '', 'first', now,
             'digest', digest)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'first', 1, '', 0}
end
local attempts = tonumber(e[1])
if digest ~= '' and e[5] and e[5] ~= '' and e[5] ~= digest then return {'other_request', attempts, '', 0} end
local age = now - tonumber(e[4] or now)
if tonumber(e[2]) > now then return {'in_progress', attempts, e[3], age} end
if attempts >= tonumber(ARGV[1]) then return {'too_many', attempts, e[3], age} end
redis.call('HSET', KEYS[1], 'attempts', attempts + 1, 'running_until', now + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'retry', attempts + 1, e[3], age}
