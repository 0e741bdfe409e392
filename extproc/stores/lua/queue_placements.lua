-- The cost placed on each backend of the pool, by every replica: {backend, cost, ...}.
return redis.call('HGETALL', P .. ':pt')
