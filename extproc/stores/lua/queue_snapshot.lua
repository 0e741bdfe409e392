-- What a replica reads of the pool (pool_state in queue.lua).
return pool_state()
