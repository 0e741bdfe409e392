-- The queue page's view of the line: class and branch of every waiting ticket, as a flat list
-- (a ticket enqueued before tickets kept their branch reads "unknown").
local out = {}
for _, m in ipairs(redis.call('ZRANGE', P .. ':wait', 0, -1)) do
  local id, class = parse_member(m)
  table.insert(out, class)
  table.insert(out, redis.call('HGET', P .. ':tk:' .. id, 'r') or 'unknown')
end
return out
