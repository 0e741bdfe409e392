-- KEYS[1] the permit counter of one opening: a probe that ended without an outcome gives its permit back.
if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then redis.call('DECR', KEYS[1]) end
return 1
