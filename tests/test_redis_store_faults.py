"""The Redis stores under faults a real redis-server can be put through: a caller that leaves
while its script call is on its way, a connection given up while it opens."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import RedisError

from extproc.stores.redis_batch import ScriptBatch
from extproc.stores.redis_connection import RedisAddress


async def test_a_call_handed_over_while_a_given_up_connection_closes_is_answered_on_its_own(redis_server):
    """A connection that could not open in time is given up, with the calls handed to it. Its
    opener ends a moment later; a call handed over meanwhile goes on the next connection, and
    hears only from that one: the old connection's end must not reach it."""
    client = RedisAddress(redis_server.url).connect(0.3)
    echo = client.register_script("return ARGV[1]")
    await echo(keys=["k"], args=["loaded"])
    calls = ScriptBatch(client, {"echo": echo}, cluster=False, op_timeout_s=0.3)
    try:
        redis_server.pause()  # the connection opens as far as the kernel goes, and waits for Redis
        try:
            with pytest.raises(TimeoutError):
                await calls.submit("echo", "k", ("first",))
            second = calls.submit("echo", "k", ("second",))  # the first connection's opener still ends
        finally:
            redis_server.resume()
        assert await second == "second"
        assert await asyncio.gather(*(calls.submit("echo", "k", (str(i),)) for i in range(5))) == [str(i) for i in range(5)]
    finally:
        await calls.close()
        await client.aclose()
