-- The shared queue of one pool, for every sidecar replica: the library its scripts share
-- (each script is the prelude, this library, and its body in queue_*.lua; see
-- extproc/stores/scripts.py). KEYS[1] is the pool's key prefix, "{extproc:POOL}": every key of
-- a pool shares that hash tag, so all of them live in one Redis Cluster slot.
--
--   P:wait    ZSET  member "round:first arrival (ms):seq:class:id", score = priority score
--                   (lower first; equal scores by fairness round, then first arrival)
--   P:arrive  ZSET  same members, score = arrival (Redis TIME, ms): oldest first, for aging
--   P:tk:ID   HASH  a waiting ticket (m member, o owner, c cost, l long, k class, b bounded: may go
--                   past the latency cap, r branch: for the live queue page),
--                   with a TTL so a crashed waiter leaves no zombie behind
--   P:lease   ZSET  admitted ticket id, score = lease expiry (Redis TIME, ms)
--   P:li      HASH  admitted ticket id -> "owner|cost|flags" (lease_info reads it; flags: FLAG_LONG,
--                   FLAG_UNBOUNDED: its class has no latency target, counted against lcap)
--   P:reaped  ZSET  ids whose lease expired, score = when (kept for REAPED_KEEP_LEASES leases):
--                   a lease missing from P:li but not here was lost by Redis, not expired
--   P:st      HASH  inflight, cost, lcost (long cost), ubinf (tickets not bounded in flight),
--                   max, budget (-1 none), share, engines (a long ticket alone may take one's
--                   part of the budget), promote,
--                   lcap (latency cap on ubinf, -1 none), spread (backends
--                   the sidecar places requests on: a ticket fits while cost + spread x its
--                   cost <= budget, see PoolLine),
--                   released (slots given back so far: the drain rate),
--                   alone (1: a long ticket waits while a bounded or another long one runs,
--                   PoolLine.long_alone), quiet (ms: ...and one not bounded until bounded
--                   tickets arrive no oftener than one per this long, PoolLine.long_quiet_s)
--   P:bat     LIST  when the last QUIET_ARRIVALS bounded tickets arrived while `alone` and `quiet`
--                   held (Redis TIME, ms), latest first
--   P:rr      HASH  "class|branch" -> the branch's next fairness round
--   P:ra      ZSET  "class|branch", score = when its last new ticket arrived (Redis TIME, ms): a
--                   branch quiet for longer than a ticket lives has nobody in line, and is
--                   forgotten (forget_quiet_branches)
--   P:rn      HASH  class -> the round being served
--   P:dc      HASH  class -> waiting tickets
--   P:seq     counter of arrivals
--   P:wake:R  LIST  ids admitted for replica R, popped by its BLPOP loop
--   P:replicas ZSET replica -> its last renewal (Redis TIME, ms): those of the last lease are
--                   live (queue_renew.lua); each counts them, for its share while Redis is down
--   P:appt    HASH  class -> the appointment book's next free time for it (Redis TIME, ms; queue_book.lua)
--   P:appt:kept ZSET request name -> its appointment (ms), kept until it is past (queue_book.lua)
--   P:pl      HASH  admitted ticket id -> the backend it runs on ("IP:PORT"; queue_place.lua)
--   P:pt      HASH  backend -> the cost of the tickets placed on it, by every replica: what each
--                   replica's picker counts as placed by the others

local P = KEYS[1]
local REAPED_KEEP_LEASES = 10

local function number_or(v, default) -- a field HMGET read (false when missing)
  if v then return tonumber(v) end
  return default
end

local function parse_member(m)
  local round, first, seq, class, id = string.match(m, '^(%d+):(%d+):(%d+):([^:]+):(.+)$')
  return id, class, tonumber(round)
end

local function is_long(flags) return bit.band(flags, FLAG_LONG) ~= 0 end
local function is_unbounded(flags) return bit.band(flags, FLAG_UNBOUNDED) ~= 0 end

-- A lease's record in P:li, "owner|cost|flags": owner, cost, flags.
local function lease_info(info)
  local owner, cost, flags = string.match(info, '^(.*)|(%d+)|(%d+)$')
  return owner, tonumber(cost), tonumber(flags)
end

local function lease_owner(id)
  local info = redis.call('HGET', P .. ':li', id)
  if not info then return nil end
  return (lease_info(info))
end

-- A slot counted in the pool's totals (sign 1) or taken out of them (sign -1).
local function count_slot(cost, flags, sign)
  local delta = cost
  if sign < 0 then delta = 0 - cost end -- (not sign * cost: Redis refuses -0 as an integer)
  redis.call('HINCRBY', P .. ':st', 'inflight', sign)
  redis.call('HINCRBY', P .. ':st', 'cost', delta)
  if is_long(flags) then redis.call('HINCRBY', P .. ':st', 'lcost', delta) end
  if is_unbounded(flags) then redis.call('HINCRBY', P .. ':st', 'ubinf', sign) end
end

-- The ticket no longer runs where it was placed (it ended, or moved).
local function unplace(id, cost)
  local endpoint = redis.call('HGET', P .. ':pl', id)
  if not endpoint then return end
  redis.call('HDEL', P .. ':pl', id)
  if redis.call('HINCRBY', P .. ':pt', endpoint, 0 - cost) <= 0 then redis.call('HDEL', P .. ':pt', endpoint) end
end

-- (`info`: its P:li record when the caller has read it already)
local function free_slot(id, info)
  info = info or redis.call('HGET', P .. ':li', id)
  if not info then return nil end
  local owner, cost, flags = lease_info(info)
  unplace(id, cost)
  redis.call('HDEL', P .. ':li', id)
  redis.call('ZREM', P .. ':lease', id)
  redis.call('HINCRBY', P .. ':st', 'released', 1)
  count_slot(cost, flags, -1)
  return owner
end

local function hold_slot(id, owner, cost, flags, expiry)
  redis.call('ZADD', P .. ':lease', expiry, id)
  redis.call('HSET', P .. ':li', id, owner .. '|' .. cost .. '|' .. flags)
end

local function reap(now, lease_ms)
  local expired = redis.call('ZRANGEBYSCORE', P .. ':lease', '-inf', now)
  if #expired == 0 then return 0 end
  for _, id in ipairs(expired) do
    free_slot(id)
    redis.call('ZADD', P .. ':reaped', now, id)
  end
  redis.call('ZREMRANGEBYSCORE', P .. ':reaped', '-inf', now - REAPED_KEEP_LEASES * lease_ms)
  return #expired
end

local function drop_waiting(m, class)
  redis.call('ZREM', P .. ':wait', m)
  redis.call('ZREM', P .. ':arrive', m)
  redis.call('HINCRBY', P .. ':dc', class, -1)
end

-- The pool's counts and limits (P:st), read in one call: every script that admits reads them.
local function read_state()
  local s = redis.call('HMGET', P .. ':st', 'inflight', 'cost', 'lcost', 'ubinf', 'max', 'budget', 'share', 'promote',
                      'lcap', 'spread', 'released', 'alone', 'engines', 'quiet')
  local st = {inflight = number_or(s[1], 0), used = number_or(s[2], 0), lused = number_or(s[3], 0),
          ub = number_or(s[4], 0), maxn = number_or(s[5], 1), budget = number_or(s[6], -1), share = number_or(s[7], 1),
          promote = number_or(s[8], -1), lcap = number_or(s[9], -1), spread = number_or(s[10], 1),
          released = number_or(s[11], 0), alone = number_or(s[12], 0), engines = number_or(s[13], 1),
          quiet = number_or(s[14], 0), bat = {}}
  if st.alone == 1 and st.quiet > 0 then -- (the times of the last bounded arrivals: only where they count)
    st.bat = redis.call('LRANGE', P .. ':bat', 0, QUIET_ARRIVALS - 1)
  end
  return st
end

-- Whether bounded tickets came oftener than one per `quiet` ms of late (PoolLine._bounded_lately).
local function bounded_lately(st, now)
  local last, first = tonumber(st.bat[1] or '-1'), tonumber(st.bat[QUIET_ARRIVALS] or '-1')
  if last < 0 or st.quiet <= 0 then return false end
  return (now >= last and now - last < st.quiet)
      or (first >= 0 and now >= first and now - first < QUIET_ARRIVALS * st.quiet)
end

local function write_counts(st)
  redis.call('HSET', P .. ':st', 'inflight', st.inflight, 'cost', st.used, 'lcost', st.lused, 'ubinf', st.ub)
end

-- Whether a ticket is admitted now (PoolLine._admits): 'yes'; 'no' (it waits, and so does everyone
-- behind it); 'lane' (its kind's share is full: those behind it may pass it); 'long' (a long one
-- that may go alone waits for the long share: those behind it may pass it, long ones may not,
-- which `long_held` says to the later calls of one pass over the line).
local function admits(cost, long, bounded, st, now, long_held)
  if st.inflight >= st.maxn then return 'no' end
  if bounded == 0 and st.lcap >= 0 and st.ub >= st.lcap then return 'lane' end
  if long == 1 and st.alone == 1
      and (st.inflight > st.ub or st.lused > 0 or bounded == 0 and bounded_lately(st, now)) then
    return 'lane'
  end
  if st.budget < 0 or st.inflight == 0 then return 'yes' end
  if long == 1 then
    if long_held then return 'lane' end
    local alone_fits = cost <= st.budget / st.engines
    if st.lused + cost > st.budget * st.share and (st.lused > 0 or not alone_fits) then
      if alone_fits then return 'long' end
      return 'lane'
    end
  end
  if st.used + cost * st.spread <= st.budget then return 'yes' end
  return 'no'
end

-- A ticket out of the line (or one that never had to join it) takes its slot: its lease, the
-- counts in `st` (written by write_counts), and its class's fairness round, now being served.
-- (`serving`: the round its class is being served in, when the caller has read it already)
local function take_slot(st, id, owner, cost, long, bounded, class, round, expiry, serving)
  if round > (serving or tonumber(redis.call('HGET', P .. ':rn', class) or '0')) then
    redis.call('HSET', P .. ':rn', class, round)
  end
  local flags = 0
  if long == 1 then flags = flags + FLAG_LONG end
  if bounded == 0 then flags = flags + FLAG_UNBOUNDED end
  hold_slot(id, owner, cost, flags, expiry)
  st.inflight, st.used = st.inflight + 1, st.used + cost
  if long == 1 then st.lused = st.lused + cost end
  if bounded == 0 then st.ub = st.ub + 1 end
end

-- What a replica reads of the pool: depth, in-flight count and cost, limits, depth by class,
-- released so far, tickets not bounded in flight.
local function pool_state()
  local s = redis.call('HMGET', P .. ':st', 'inflight', 'cost', 'max', 'budget', 'released', 'ubinf')
  return {redis.call('ZCARD', P .. ':wait'), s[1] or '0', s[2] or '0', s[3] or '1', s[4] or '-1',
          redis.call('HGETALL', P .. ':dc'), s[5] or '0', s[6] or '0'}
end

-- pool_state() as `st` (read_state, then counted) has it, for a call that found nobody in line
-- and left nobody there: depth 0, no class waiting. Nothing more to read.
local function state_of(st)
  return {0, st.inflight, st.used, st.maxn, st.budget, {}, st.released, st.ub}
end

-- The branches whose last new ticket arrived before `before` (longer ago than a ticket lives:
-- none of theirs is in line) are forgotten: the next ticket of one joins the round being served,
-- as a new branch's does. A few at a time, oldest first: each arrival adds at most one.
local function forget_quiet_branches(before)
  local quiet = redis.call('ZRANGEBYSCORE', P .. ':ra', '-inf', '(' .. before, 'LIMIT', 0, 8)
  if #quiet == 0 then return end
  redis.call('HDEL', P .. ':rr', unpack(quiet))
  redis.call('ZREM', P .. ':ra', unpack(quiet))
end

-- A ticket leaves the line, if it is in it (true then): withdrawn by its waiter, or counted as
-- running by its owner's renewal after Redis missed its admission (it must not be admitted and
-- counted again).
local function leave_line(id)
  local m = redis.call('HGET', P .. ':tk:' .. id, 'm')
  if not m then return false end
  local _, class = parse_member(m)
  drop_waiting(m, class)
  redis.call('DEL', P .. ':tk:' .. id)
  return true
end

-- Admit from the head of the line while the head fits, counting in `st` (read_state, after the
-- expired leases were reaped); returns the admitted ids. Each admitted ticket's replica hears of
-- it through its wake list, except `caller` (the ticket of the script call itself, which learns
-- of its admission from the answer).
local function admit_from_line(now, lease_ms, caller, st)
  local admitted, passed, long_held = {}, {}, false
  while true do
    local m = nil
    if st.promote >= 0 then
      for _, a in ipairs(redis.call('ZRANGEBYSCORE', P .. ':arrive', '-inf', now - st.promote, 'LIMIT', 0, 16)) do
        if not passed[a] then m = a; break end
      end
    end
    if not m then
      for _, w in ipairs(redis.call('ZRANGE', P .. ':wait', 0, 63)) do
        if not passed[w] then m = w; break end
      end
    end
    if not m then break end
    local id, class, round = parse_member(m)
    local tk = redis.call('HMGET', P .. ':tk:' .. id, 'o', 'c', 'l', 'b')
    if not tk[1] then
      drop_waiting(m, class) -- a zombie: its waiter is gone and its TTL ran out
    else
      local owner, cost, long, bounded = tk[1], tonumber(tk[2]), tonumber(tk[3]), tonumber(tk[4] or '1')
      local verdict = admits(cost, long, bounded, st, now, long_held)
      if verdict == 'no' then break end
      if verdict == 'lane' or verdict == 'long' then
        passed[m] = true
        long_held = long_held or verdict == 'long'
      else
        drop_waiting(m, class)
        redis.call('DEL', P .. ':tk:' .. id)
        take_slot(st, id, owner, cost, long, bounded, class, round, now + lease_ms)
        if id ~= caller then
          redis.call('RPUSH', P .. ':wake:' .. owner, id)
          redis.call('PEXPIRE', P .. ':wake:' .. owner, 60000)
        end
        table.insert(admitted, id)
      end
    end
  end
  if #admitted > 0 then write_counts(st) end
  return admitted
end

-- What every script that frees or changes room runs: reap the expired leases, then admit from
-- the line (nobody in line: nothing to read).
local function dispatch(now, lease_ms, caller)
  reap(now, lease_ms)
  if redis.call('ZCARD', P .. ':wait') == 0 then return {} end
  return admit_from_line(now, lease_ms, caller, read_state())
end
