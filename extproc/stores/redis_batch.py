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
in order by one task that feeds hiredis' reader, which answers the call. Nothing per call or
per turn goes through redis-py's connection pool or its per-command reads, which cost more,
measured per request, than the script calls themselves. redis-py still opens the connection
(address, credentials, database, TLS, the master Sentinel names). Each connection keeps its own
calls (`_Link`): one given up while its opening or its reading still runs ends alone, and never
answers, nor fails, a call handed to the one after it.

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


class _Link:
    """One connection of the pipe's, from its opening to its end: the calls handed to it, in
    order (held while it opens, then written, each waiting for its reply), and the tasks that
    open it and read its replies. Nothing of one link reaches another's calls: a link given up
    while its opener or reader still runs ends alone."""

    __slots__ = ("opened_at", "connection", "unsent", "pending", "opening", "reading", "ended")

    def __init__(self, opened_at: float):
        self.opened_at = opened_at  # loop time: the bound of the calls held while it opens runs from here
        self.connection = None  # redis-py's, opened by it; written and read here
        self.unsent: list[tuple[bytes, Callable[[object], None]]] = []  # handed over while it opens
        self.pending: deque[tuple[float, Callable[[object], None]]] = deque()  # (deadline, handler), as written
        self.opening: asyncio.Task | None = None
        self.reading: asyncio.Task | None = None
        self.ended = False


class _Pipe:
    """Commands written as they are handed over on the current connection (`_Link`), their
    replies read by its one task, in order, each handed to its command's handler (a reply, or
    the exception that ended the connection under it)."""

    def __init__(self, client, timeout_s: float):
        self._client = client
        self._timeout_s = timeout_s
        self._link: _Link | None = None  # the connection calls go on now; None: the next call opens one
        self._timer: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Task] = set()

    def send(self, commands: list[tuple[bytes, Callable[[object], None]]]) -> None:
        loop = asyncio.get_running_loop()
        link = self._link
        if link is None:
            link = self._link = _Link(loop.time())
            link.opening = loop.create_task(self._open(link))
        if link.connection is None:
            link.unsent.extend(commands)
            self._arm(loop, link.opened_at + self._timeout_s)
        else:
            self._write(loop, link, commands)

    def _write(self, loop: asyncio.AbstractEventLoop, link: _Link,
               commands: list[tuple[bytes, Callable[[object], None]]]) -> None:
        deadline = loop.time() + self._timeout_s
        link.connection._writer.writelines([packed for packed, _ in commands])
        link.pending.extend((deadline, handler) for _, handler in commands)
        self._arm(loop, deadline)

    async def _open(self, link: _Link) -> None:
        connection = self._client.connection_pool.make_connection()  # outside the pool: the pipe's own
        try:
            async with asyncio.timeout(self._timeout_s):
                await connection.connect()
        except BaseException as error:  # noqa: BLE001 - every call handed to the link must hear of it
            link.opening = None
            self._end(link, error if isinstance(error, Exception) else RedisConnectionError("connection given up"))
            await _disconnect(connection)
            return
        link.opening = None
        if link.ended:  # given up while it opened, its calls failed: nothing may go on it
            await _disconnect(connection)
            return
        link.connection = connection
        link.reading = asyncio.get_running_loop().create_task(self._read(link))
        unsent, link.unsent = link.unsent, []
        if unsent:
            self._write(asyncio.get_running_loop(), link, unsent)

    async def _read(self, link: _Link) -> None:
        reader = hiredis.Reader(encoding="utf-8", replyError=_reply_error)
        stream = link.connection._reader
        pending = link.pending
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
            link.reading = None
            self._end(link, error)

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._check)

    def _check(self) -> None:
        """The oldest call's bound: past it, the connection is given up with every call on it."""
        self._timer = None
        link = self._link
        if link is None:
            return
        if link.pending:
            oldest = link.pending[0][0]
        elif link.unsent:
            oldest = link.opened_at + self._timeout_s
        else:
            return
        loop = asyncio.get_running_loop()
        if oldest <= loop.time():
            self._end(link, TimeoutError(f"no answer from Redis within {self._timeout_s:g} s"))
        else:
            self._arm(loop, oldest)

    def _end(self, link: _Link, error: Exception) -> None:
        """Give a connection up: every call written on it, or waiting for it to open, fails;
        the next call opens another. Only the pipe's current connection is its to drop."""
        if link.ended:
            return
        link.ended = True
        if self._link is link:
            self._link = None
        for task in (link.reading, link.opening):
            if task is not None:
                task.cancel()
        link.reading = link.opening = None
        if link.connection is not None:
            task = asyncio.get_running_loop().create_task(_disconnect(link.connection))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        pending, link.pending = link.pending, deque()
        unsent, link.unsent = link.unsent, []
        for _, handler in pending:
            handler(error)
        for _, handler in unsent:
            handler(error)

    def close_if_idle(self) -> None:
        link = self._link
        if link is not None and link.connection is not None and not link.pending:
            self._end(link, RedisConnectionError("closed"))

    async def close(self) -> None:
        if self._link is not None:
            self._end(self._link, RedisConnectionError("the store is closed"))
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
