-- KEYS[1] pool prefix. ARGV: levels, then per level: name, bucket_ms, buckets, n, n x (index, requests, failures).
-- Returns {now_ms, state fields (flat), then per level a flat list of index, requests, failures}.
local P = KEYS[1]
local now = now_ms()
local out = {now, redis.call('HGETALL', P .. ':breaker')}
local i = 2
for _ = 1, tonumber(ARGV[1]) do
  local name, bucket_ms, buckets, n = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  i = i + 4
  local key = P .. ':bw:' .. name
  for _ = 1, n do
    redis.call('HINCRBY', key, ARGV[i] .. ':r', ARGV[i + 1])
    redis.call('HINCRBY', key, ARGV[i] .. ':f', ARGV[i + 2])
    i = i + 3
  end
  local first_live = math.floor(now / bucket_ms) - buckets + 1
  local counts, flat = {}, {}
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do
    local index, kind = string.match(all[j], '^(-?%d+):(%a)$')
    index = tonumber(index)
    if index < first_live then
      redis.call('HDEL', key, all[j])
    else
      counts[index] = counts[index] or {0, 0}
      if kind == 'r' then counts[index][1] = tonumber(all[j + 1]) else counts[index][2] = tonumber(all[j + 1]) end
    end
  end
  for index, c in pairs(counts) do
    table.insert(flat, index); table.insert(flat, c[1]); table.insert(flat, c[2])
  end
  redis.call('PEXPIRE', key, bucket_ms * buckets * 2)
  table.insert(out, flat)
end
return out
