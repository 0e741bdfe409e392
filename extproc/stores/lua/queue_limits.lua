-- New limits for the pool. ARGV: max in flight, token budget (-1 none), long share, promote
-- after ms (-1 never), lease ms, latency cap (-1 none), spread, long alone (1: a long ticket
-- waits while a bounded or another long one runs), engines, long quiet ms (...and, one not bounded,
-- until bounded tickets arrive no oftener than one per this long: PoolLine.long_quiet_s).
-- Returns the admitted ids.
redis.call('HSET', P .. ':st', 'max', ARGV[1], 'budget', ARGV[2], 'share', ARGV[3], 'promote', ARGV[4], 'lcap', ARGV[6],
           'spread', ARGV[7], 'alone', ARGV[8], 'engines', ARGV[9], 'quiet', ARGV[10])
return dispatch(now_ms(), tonumber(ARGV[5]))
