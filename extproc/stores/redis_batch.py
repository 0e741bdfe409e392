"""Script calls to Redis, handed over at once and sent together on one connection kept open.

A call is queued before the caller can be suspended, so a caller cancelled afterwards cannot
take it back (a release must happen even when Envoy resets the stream that asked for it). Calls
are written together under load: a call handed over within `COMPANY_S` of the one before it
waits for company, at most `URGENT_LINGER_S` (2 ms) when someone waits on its answer (`urgent`),
at most `LINGER_S` when nobody does, and a write carries several requests' enqueues and
releases. A call that comes alone goes in the next turn of the loop: a quiet replica adds no
wait to a decision. Calls of a `mergeable` script to the same key go as one call: its arguments
are `fixed` leading ones, then items, and the first element of its answer has one entry per
item (each call carries one item). On a Cluster every call goes alone, through the client (a
pipeline would span slots).

Off a Cluster the calls go on one connection of the batch's own (`_Pipe`): each is packed by
hiredis' C packer as it is handed over, written with the others of its write, and its reply read
in order by one task that feeds hiredis' reader, which answers the call. Nothing per call or per
turn goes through redis-py's connection pool or its per-command reads, which cost more, measured
per request, than the script calls themselves. redis-py still opens the connection (address,
credentials, database, TLS, the master Sentinel names).

Every call is bounded by `op_timeout_s` from when it is written (its connection's opening by
the same bound): past it, the connection is closed, never reused with a reply still to come,
and every call on it fails; the next call opens a new one. A call is never sent twice, except
one that Redis refused because it forgot the script (a restart): the script is loaded again
and only the refused calls are sent again.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, RedisError, ResponseError

LINGER_S = 0.004  # under load, a call that is not urgent waits at most this long for others
# Under load, an urgent call (someone waits on its answer: an enqueue) waits at most this long.
# Each write costs a send on a loopback or network socket and a wakeup on both sides; measured
# under load (extproc bench overhead's Redis setup, side by side in one rig, where every call
# has company): writing what 1 ms gathers took 6 % off the sidecar's CPU per request against
# the calls of one loop turn, and what 2 ms gathers 4.6 % more (3 ms: 2.3 % more again, and
# fewer requests a second: the wait shows).
URGENT_LINGER_S = 0.002
# A call handed over within this long of the previous one has company coming: it lingers.
COMPANY_S = 0.002


def _reply_error(message: str) -> ResponseError:
    """An error reply as redis-py raises it (a script Redis does not know: NoScriptError)."""
    return NoScriptError(message) if message.startswith("NOSCRIPT") else ResponseError(message)


class ScriptBatch:
    def __init__(self, client, scripts: dict[str, object], cluster: bool, op_timeout_s: float,
                 mergeable: dict[str, int] | None = None):
        self._client = client
        self._scripts = scripts  # name -> registered redis-py Script
        self._cluster = cluster
        self._op_timeout_s = op_timeout_s
        self._mergeable = mergeable or {}  # name -> number of fixed leading arguments
        self._batch: list = []  # (script name, key, args, future) waiting for the pending write
        self._flush_at: float | None = None  # when the pending batch goes (loop time)
        self._flush_handle: asyncio.Handle | None = None
        self._last_call_at = -math.inf  # when the previous call was handed over (loop time)
        self._pipe = None if cluster else _Pipe(client, op_timeout_s)
        self._loading: dict[str, asyncio.Future] = {}  # script name -> its load under way (after a restart)
        self._background: set[asyncio.Task] = set()

    def submit(self, name: str, key: str, args: tuple, urgent: bool = True) -> asyncio.Future:
        """Hand one call over now; return its answer to come."""
        loop = asyncio.get_running_loop()
        if self._cluster:
            return loop.create_task(self._call_alone(name, key, args))
        future = loop.create_future()
        self._batch.append((name, key, args, future))
        # The pending write goes at the earliest bound of the calls in it: a call only ever
        # brings it forward, never puts it off. A call that comes alone has no company to wait for.
        now = loop.time()
        crowded = now - self._last_call_at < COMPANY_S
        self._last_call_at = now
        flush_by = now + ((URGENT_LINGER_S if urgent else LINGER_S) if crowded else 0.0)
        if self._flush_at is None or self._flush_at > flush_by:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._flush_at = flush_by
            self._flush_handle = loop.call_at(flush_by, self._flush)
        return future

    async def _call_alone(self, name: str, key: str, args: tuple) -> object:
        async with asyncio.timeout(self._op_timeout_s):
            return await self._scripts[name](keys=[key], args=list(args))

    def drop_idle(self) -> None:
        """Close the connection if no call waits on it (after an outage: it may be dead)."""
        if self._pipe is not None:
            self._pipe.close_if_idle()

    async def close(self) -> None:
        if self._pipe is not None:
            await self._pipe.close()

    def _flush(self) -> None:
        self._flush_at = self._flush_handle = None
        batch, self._batch = self._batch, []
        calls: list[tuple[str, str, list, list[asyncio.Future]]] = []  # (name, key, args, futures)
        merged: dict[tuple[str, str], int] = {}  # (name, key) -> its call in `calls`
        for name, key, args, future in batch:
            fixed = self._mergeable.get(name)
            at = merged.get((name, key)) if fixed is not None else None
            if at is None:
                if fixed is not None:
                    merged[(name, key)] = len(calls)
                calls.append((name, key, list(args), [future]))
            else:
                calls[at][2].extend(args[fixed:])
                calls[at][3].append(future)
        self._write(calls)

    def _write(self, calls: list[tuple[str, str, list, list[asyncio.Future]]]) -> None:
        assert self._pipe is not None
        commands = []
        for call in calls:
            name, key, args, futures = call
            try:
                packed = hiredis.pack_command(("EVALSHA", self._scripts[name].sha, 1, key, *args))
            except TypeError as error:  # an argument Redis cannot take (None, a bool): as redis-py says it
                _fail(futures, DataError(str(error)))
                continue
            commands.append((packed, lambda reply, call=call: self._answer(call, reply)))
        if commands:
            self._pipe.send(commands)

    def _answer(self, call: tuple[str, str, list, list[asyncio.Future]], reply: object) -> None:
        name, _, _, futures = call
        if isinstance(reply, NoScriptError):  # Redis restarted: load it again, send this call again
            self._again(call)
        elif isinstance(reply, BaseException):
            _fail(futures, reply)
        elif name in self._mergeable:
            items = reply[0] if isinstance(reply, list) and reply and isinstance(reply[0], list) else None
            if items is None or len(items) != len(futures):
                _fail(futures, ResponseError(f"{name}: {len(futures)} answers expected, got {reply!r}"))
                return
            for future, item in zip(futures, items, strict=True):
                if not future.done():
                    future.set_result(item)
        else:
            for future in futures:
                if not future.done():
                    future.set_result(reply)

    def _again(self, call: tuple[str, str, list, list[asyncio.Future]]) -> None:
        name = call[0]
        loading = self._loading.get(name)
        if loading is None:
            loading = self._loading[name] = asyncio.ensure_future(self._load(name))
            loading.add_done_callback(lambda _: self._loading.pop(name, None))

        def resend(done: asyncio.Future) -> None:
            error = done.exception() if not done.cancelled() else RedisError("script load cancelled")
            if error is not None:
                _fail(call[3], error if isinstance(error, Exception) else RedisError(str(error)))
            else:
                self._write([call])

        loading.add_done_callback(resend)

    async def _load(self, name: str) -> None:
        script = self._scripts[name]
        async with asyncio.timeout(self._op_timeout_s):
            script.sha = await self._client.script_load(script.script)


def _fail(futures: list[asyncio.Future], error: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)


class _Pipe:
    """One connection to Redis: commands written as they are handed over, their replies read
    by one task, in order, each handed to its command's handler (a reply, or the exception that
    ended the connection under it)."""

    def __init__(self, client, timeout_s: float):
        self._client = client
        self._timeout_s = timeout_s
        self._connection = None  # redis-py's, opened by it; written and read here
        self._opening: asyncio.Task | None = None
        self._unsent: list[tuple[bytes, Callable[[object], None]]] = []  # handed over while it opens
        self._unsent_since = 0.0
        self._pending: deque[tuple[float, Callable[[object], None]]] = deque()  # (deadline, handler), as written
        self._reading: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Task] = set()

    def send(self, commands: list[tuple[bytes, Callable[[object], None]]]) -> None:
        loop = asyncio.get_running_loop()
        if self._connection is None:
            if not self._unsent:
                self._unsent_since = loop.time()
            self._unsent.extend(commands)
            if self._opening is None:
                self._opening = loop.create_task(self._open())
            self._arm(loop, self._unsent_since + self._timeout_s)
            return
        deadline = loop.time() + self._timeout_s
        self._connection._writer.writelines([packed for packed, _ in commands])
        self._pending.extend((deadline, handler) for _, handler in commands)
        self._arm(loop, deadline)

    async def _open(self) -> None:
        connection = self._client.connection_pool.make_connection()  # outside the pool: the pipe's own
        try:
            async with asyncio.timeout(self._timeout_s):
                await connection.connect()
        except BaseException as error:  # noqa: BLE001 - every call handed over must hear of it
            self._opening = None
            await _disconnect(connection)
            unsent, self._unsent = self._unsent, []
            failure = error if isinstance(error, Exception) else RedisConnectionError(str(error))
            for _, handler in unsent:
                handler(failure)
            return
        self._opening = None
        self._connection = connection
        self._reading = asyncio.get_running_loop().create_task(self._read(connection))
        unsent, self._unsent = self._unsent, []
        if unsent:
            self.send(unsent)

    async def _read(self, connection) -> None:
        reader = hiredis.Reader(encoding="utf-8", replyError=_reply_error)
        stream = connection._reader
        pending = self._pending
        try:
            while True:
                data = await stream.read(65536)
                if not data:
                    raise RedisConnectionError("Connection closed by server.")
                reader.feed(data)
                while (reply := reader.gets()) is not False:
                    pending.popleft()[1](reply)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the calls waiting on it fail with it
            if self._connection is connection:
                self._lose(error)

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._check)

    def _check(self) -> None:
        """The oldest call's bound: past it, the connection is given up with every call on it."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        oldest = self._pending[0][0] if self._pending else None
        if self._unsent and (oldest is None or self._unsent_since + self._timeout_s < oldest):
            oldest = self._unsent_since + self._timeout_s
        if oldest is None:
            return
        if oldest <= now:
            self._lose(TimeoutError(f"no answer from Redis within {self._timeout_s:g} s"))
        else:
            self._arm(loop, oldest)

    def _lose(self, error: Exception) -> None:
        """Give the connection up: every call written on it, or waiting for it, fails."""
        connection = self._take_connection()
        if connection is not None:
            task = asyncio.get_running_loop().create_task(_disconnect(connection))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        pending, self._pending = self._pending, deque()
        unsent, self._unsent = self._unsent, []
        for _, handler in pending:
            handler(error)
        for _, handler in unsent:
            handler(error)

    def _take_connection(self):
        connection, self._connection = self._connection, None
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None
        return connection

    def close_if_idle(self) -> None:
        if self._connection is not None and not self._pending and not self._unsent:
            self._lose(RedisConnectionError("closed"))

    async def close(self) -> None:
        self._lose(RedisConnectionError("the store is closed"))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closing:
            await asyncio.gather(*self._closing)


async def _disconnect(connection) -> None:
    try:
        await asyncio.wait_for(connection.disconnect(nowait=True), 1)
    except (Exception, asyncio.CancelledError):
        pass
