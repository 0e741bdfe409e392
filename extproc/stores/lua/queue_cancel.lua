-- A ticket leaves the line. ARGV: id, lease ms.
-- Returns {'removed', admitted ids}, {'holds', {}} (it was admitted: the caller owns the slot)
-- or {'unknown', {}}.
local id = ARGV[1]
if leave_line(id) then return {'removed', dispatch(now_ms(), tonumber(ARGV[2]))} end
if redis.call('HEXISTS', P .. ':li', id) == 1 then return {'holds', {}} end
return {'unknown', {}}
