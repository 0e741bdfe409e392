"""A TCP forwarder on loopback whose target can be switched: the stand-in for a DNS name or a
virtual IP that a managed Redis moves to the promoted replica on failover."""

from __future__ import annotations

import asyncio
import contextlib

from extproc_testbed.stack import LOOPBACK, free_port


class SwitchableProxy:
    def __init__(self, target_port: int):
        self.port = free_port()
        self.target_port = target_port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.dropping = False  # swallow traffic instead of forwarding it (a link that lags, then dies)

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    async def start(self) -> SwitchableProxy:
        self._server = await asyncio.start_server(self._connect, LOOPBACK, self.port)
        return self

    async def _connect(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, server_writer}
        await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer))
        self._writers -= {client_writer, server_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.dropping:
                    writer.write(data)
                    await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    def switch(self, target_port: int) -> None:
        """New connections go to `target_port`; open ones are cut, as a failover cuts them."""
        self.target_port = target_port
        self._cut_all()

    def _cut_all(self) -> None:
        for writer in list(self._writers):
            writer.close()

    async def stop(self) -> None:
        self._cut_all()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
