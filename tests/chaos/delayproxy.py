"""A TCP forwarder with an adjustable one-way delay and a switch that partitions it.

Each chunk sent towards the upstream is written ``delay_s`` after it arrived, in order
(like ``netem delay`` on the link towards the zone: latency added one way, ordering
kept); replies flow back undelayed. :meth:`DelayProxy.sever` holds every byte in both
directions and every new connection until :meth:`DelayProxy.mend`, as TCP across a
partitioned network does: nothing is lost or reset, it arrives after the mend.
It runs on its own thread and event loop so blocking test code cannot stall it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from llmesh.procs import free_port


class DelayProxy:
    """Listens on 127.0.0.1:<port> and forwards every connection to ``upstream`` (host:port)."""

    def __init__(self, upstream: str) -> None:
        self.upstream_host, _, port = upstream.rpartition(":")
        self.upstream_port = int(port)
        self.port = free_port()
        self.delay_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._open = asyncio.Event()  # clear while severed

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def pump_out() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._open.wait()
                writer.write(data)
                await writer.drain()

        out = asyncio.create_task(pump_out())
        try:
            while True:
                data = await reader.read(65536)
                queue.put_nowait((time.monotonic() + (self.delay_s if delayed else 0.0), data))
                if not data:
                    break
            await out
        except (ConnectionError, OSError):
            out.cancel()
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await self._open.wait()  # a connection made across a partition waits for the mend
        try:
            up_r, up_w = await asyncio.wait_for(
                asyncio.open_connection(self.upstream_host, self.upstream_port), timeout=2.0)
        except (OSError, TimeoutError):
            client_w.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await asyncio.gather(self._pipe(client_r, up_w, True), self._pipe(up_r, client_w, False))
        finally:
            self._conns.discard(task)

    async def _start(self) -> None:
        self._open.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()

    def start(self) -> DelayProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def sever(self) -> None:
        """Partition the link: bytes and new connections wait until :meth:`mend`."""
        self._loop.call_soon_threadsafe(self._open.clear)

    def mend(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
