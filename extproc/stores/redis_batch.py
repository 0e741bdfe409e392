"""Script calls to Redis, handed over at once and sent together.

A call is queued before the caller can be suspended, so a caller cancelled afterwards cannot
take it back (a release must happen even when Envoy resets the stream that asked for it). The
calls made in one turn of the event loop (under load, several requests' enqueues and releases)
go together in one pipeline; a call that is not `urgent` (nobody waits on its answer) may wait
`LINGER_S` for company. Calls of a `mergeable` script to the same key go as one call: its
arguments are `fixed` leading ones, then items, and the first element of its answer has one
entry per item (each call carries one item). On a Cluster every call goes alone (a pipeline would span slots). Every call
is bounded by `op_timeout_s`; a script Redis forgot (a restart) is loaded again, and only the
calls it refused are sent again: no call runs twice.

A batch is written on one pooled connection as it is, packed by hiredis' C packer, and its
replies read in order; redis-py's Pipeline would pack it in Python and time each reply
apart (both cost more than the script calls themselves, measured per request). The batch's
one bound is `op_timeout_s`.
"""

from __future__ import annotations

import asyncio
import math

import hiredis
from redis.exceptions import DataError, NoScriptError, RedisError, ResponseError

LINGER_S = 0.002  # a call that is not urgent waits at most this long for others


class ScriptBatch:
    def __init__(self, client, scripts: dict[str, object], cluster: bool, op_timeout_s: float,
                 mergeable: dict[str, int] | None = None):
        self._client = client
        self._scripts = scripts  # name -> registered redis-py Script
        self._cluster = cluster
        self._op_timeout_s = op_timeout_s
        self._mergeable = mergeable or {}  # name -> number of fixed leading arguments
        self._batch: list = []  # (script name, key, args, future) waiting for the end of this turn
        self._flush_at: float | None = None  # when the pending batch goes (loop time)
        self._flush_handle: asyncio.Handle | None = None
        self._sending: set[asyncio.Task] = set()

    def submit(self, name: str, key: str, args: tuple, urgent: bool = True) -> asyncio.Future:
        """Hand one call over now; return its answer to come."""
        loop = asyncio.get_running_loop()
        if self._cluster:
            return loop.create_task(self._call_alone(name, key, args))
        future = loop.create_future()
        self._batch.append((name, key, args, future))
        if urgent:
            if self._flush_at is None or self._flush_at > loop.time():
                if self._flush_handle is not None:
                    self._flush_handle.cancel()
                self._flush_at = loop.time()
                self._flush_handle = loop.call_soon(self._flush)
        elif self._flush_at is None:
            self._flush_at = loop.time() + LINGER_S
            self._flush_handle = loop.call_later(LINGER_S, self._flush)
        return future

    async def _call_alone(self, name: str, key: str, args: tuple) -> object:
        async with asyncio.timeout(self._op_timeout_s):
            return await self._scripts[name](keys=[key], args=list(args))

    def _flush(self) -> None:
        self._flush_at = self._flush_handle = None
        batch, self._batch = self._batch, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list) -> None:
        try:
            async with asyncio.timeout(self._op_timeout_s):
                results = await self._pipeline(batch)
                missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
                if missing:  # Redis restarted: load them again, and send again only what did not run
                    for name in {batch[i][0] for i in missing}:
                        script = self._scripts[name]
                        script.sha = await self._client.script_load(script.script)
                    for i, result in zip(missing, await self._pipeline([batch[i] for i in missing]), strict=True):
                        results[i] = result
        except BaseException as error:  # noqa: BLE001 - every caller must hear of it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(error if isinstance(error, Exception) else RedisError(str(error)))
            return
        for (*_, future), result in zip(batch, results, strict=True):
            if not future.done():
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def _pipeline(self, batch: list) -> list:
        """Send a batch in one pipeline, mergeable calls merged. Returns one answer per entry."""
        calls: list[tuple] = []  # (name, key, args, [batch positions])
        merged: dict[tuple[str, str], int] = {}  # (name, key) -> its call in `calls`
        for position, (name, key, args, _) in enumerate(batch):
            fixed = self._mergeable.get(name)
            at = merged.get((name, key)) if fixed is not None else None
            if at is None:
                if fixed is not None:
                    merged[(name, key)] = len(calls)
                calls.append((name, key, list(args), [position]))
            else:
                calls[at][2].extend(args[fixed:])
                calls[at][3].append(position)
        replies = await self._send_together([("EVALSHA", self._scripts[name].sha, 1, key, *args)
                                             for name, key, args, _ in calls])
        answers: list = [None] * len(batch)
        for (name, _, _, positions), reply in zip(calls, replies, strict=True):
            if name in self._mergeable and not isinstance(reply, Exception):
                for position, item in zip(positions, reply[0], strict=True):
                    answers[position] = item
            else:
                for position in positions:
                    answers[position] = reply
        return answers

    async def _send_together(self, commands: list[tuple]) -> list:
        """Write the commands on one connection at once and read a reply to each (an error
        reply, such as a script Redis does not know, is that command's answer). A connection
        that fails or is cancelled mid-batch is closed, never handed back half read."""
        pool = self._client.connection_pool
        connection = await pool.get_connection()
        try:
            try:
                packed = [hiredis.pack_command(command) for command in commands]
            except TypeError as error:  # an argument Redis cannot take (None, a bool): as redis-py says it
                raise DataError(str(error)) from None
            await connection.send_packed_command(packed)
            replies: list = []
            for _ in commands:
                try:  # (no timer per reply: the batch's bound is the caller's)
                    replies.append(await connection.read_response(timeout=math.inf))
                except ResponseError as error:
                    replies.append(error)
            return replies
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)
