-- A ticket leaves the line. ARGV: id, lease ms.
-- Returns {'removed', admitted ids}, {'holds', {}} (it was admitted: the caller owns the slot)
-- or {'unknown', {}}.
local id = ARGV[1]
local m = redis.call('HGET', P .. ':tk:' .. id, 'm')
if m then
  local _, class = parse_member(m)
  drop_waiting(m, class)
  redis.call('DEL', P .. ':tk:' .. id)
  return {'removed', dispatch(now_ms(), tonumber(ARGV[2]))}
end
if redis.call('HEXISTS', P .. ':li', id) == 1 then return {'holds', {}} end
return {'unknown', {}}
